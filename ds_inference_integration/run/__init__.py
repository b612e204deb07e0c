"""Around every step, the run itself: how a rank exits (`lifecycle`), a rank that stops answering
(`watchdog`), atomic output files (`files`), the output directory's lock (`output_dir`), memory (`memory`),
the garbage collector paused while a model is built (`collector`), starting and watching local ranks (`ranks`)."""
