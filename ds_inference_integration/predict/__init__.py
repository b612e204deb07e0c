"""Step 4, predicting: the Trainer mixin (`trainer`), the same batches on every rank of a TP group
(`lockstep`), length grouping, streamed and resumable predictions (`streaming`), the metrics, position ids
(`positions`), and a run's data files, checked before anything loads (`data_files`)."""
