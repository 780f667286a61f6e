"""Checkpoints of a run: the DCP layout, the saves beside training, the checkpoint on a preemption notice, the lease on --out.

`checkpoint` is what a checkpoint holds and how it loads and exports; `saver` makes the saves
(`Checkpointer.take` behind a step, `save` once the next step is queued); `preemption` reads notices and
settles, on every rank alike, whether a checkpoint fits before the node goes; `lease` keeps one live run
per run directory. Imports the step room (EMA), input (the cursor a checkpoint records), observe, and
nothing of the loop.
"""
