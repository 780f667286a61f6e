"""Pretraining and fine-tuning on Ray Train + FSDP2: the driver, the session and the worker loop, over four rooms.

At the top: `config` (TrainConfig, its `sections`) and `presets` say what a run is; `driver` checks it before
any cluster work and runs `loop.train_loop_per_worker` on every worker, through `session` (the worker's link
to Ray Train); `state` holds what a rank is and what the ranks agree on; `finetune` and `resources` serve the
driver and the loop. The loop reads its rooms, which never read it:

    input/          what a rank trains on: the data plan, the feeder, prefetch, the cursor and positions
    checkpointing/  checkpoints: DCP saves, the saver beside training, preemption, the lease on --out
    observe/        what a run shows: metrics, sinks, the training thread's stacks, MFU
    step/           the step itself, without Ray: model, optimizer, objectives, mixing, FP8, EMA
"""
