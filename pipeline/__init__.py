"""The system around the model, in rooms whose arrows only go down.

    pipeline.train  pretraining on Ray Train + FSDP2: config and presets, model setup, the optimizer step,
                    checkpoints, metrics, the worker loop, the driver (checks before any cluster work, fit)
    pipeline.embed  the embedding job: config, what --weights resolves to, the model actor, Parquet output
         |  (train and embed never import each other)
         v
    pipeline.data   shards -> uint8 patch rows: shard URLs, the tar stream, decode/crop/patchify, the Ray
                    datasource, dataset assembly and batching, bad-sample accounting, shard writing
         |
         v
    pipeline.storage (fsspec paths, staged writes, uploads), pipeline.dcp (a checkpoint's layout and its
    model read back safely, shared by train and embed), pipeline.compat (the one module touching private
    APIs of torch / fsspec / Ray), pipeline.cli (the command-line dialect every job shares), and `vit`

Importing the package imports nothing heavy: no Ray, no torch. `pipeline.data` never imports torch
(every Ray Data decode worker imports it); modules that need Ray import it inside the functions that
use it, so the training step runs and benchmarks on a bare GPU machine without Ray installed.
"""
