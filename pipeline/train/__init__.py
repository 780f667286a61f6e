"""Pretraining on Ray Train + FSDP2.

`config` (TrainConfig) and `presets` say what a run is; `driver` checks it before any cluster work and
runs `loop.train_loop_per_worker` on every worker, which builds the sharded model (`model`), steps it
(`step`, `optim`), logs (`metrics`) and checkpoints (`checkpoint`). `model`, `step`, `optim` and
`checkpoint` need no Ray: they run under torchrun or in one process too (the train benchmark).
"""
