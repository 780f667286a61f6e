"""What a rank trains on, epoch by epoch: the data plan, its feeder process, the prefetch thread, the cursor and the positions by sample.

The loop asks `dataplan.DataPlan` for an epoch's step inputs (`prefetch.Prefetcher`, or `feeder.FeederInputs`
from a process of the rank's own) and keeps where the rank stands in the epoch (`cursor.EpochCursor`), which
a checkpoint records by micro-batch and by sample (`position`, `source_position`). Imports the data room,
the top of train/ (config, state, resources) and nothing of the loop.
"""
