"""Step 4, predicting: the Trainer mixin (`trainer`: the seams in upstream's Trainer), what it does when made (`setup`),
each prediction step and loop (`loop`), one process's rows from the replicas (`gather`), the results files and speed
metrics (`results`), the same batches on every rank of a TP group (`lockstep`), each batch's sampling seed
(`sampling`), length grouping, streamed and resumable predictions (`streaming`, and `to_file`: the Trainer's
`predict_to_file`), the metrics, position ids (`positions`), and what the parser checks before anything loads: a
run's data files (`data_files`) and a speech model's languages (`languages`)."""
