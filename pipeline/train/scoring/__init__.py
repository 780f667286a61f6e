"""What a run's checkpoints are worth, and the best one kept: the checkpoint probe beside training and its
results on rank 0, the validation split, the best checkpoint and its export.

`probe` scores every checkpoint as saved, in a Ray task of its own beside the workers (Ray Train's
validation hook), with a scorer the job hands in (`pipeline.evaluate.checkpoint_probe.score`: train never
imports the embedding or evaluate rooms); `results` is rank 0's side, the records taken into the run's rows,
log and sinks; `best` ranks the checkpoints (`--keep-best`) and writes ``best/``; `sets` checks the probe's
shards and carves the validation split before any cluster work. Imports observe (the log, the rows) and
step (the model's config), and nothing of the loop.
"""
