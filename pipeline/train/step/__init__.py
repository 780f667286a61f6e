"""The optimizer step and what it is made of, without Ray: the model, the optimizer, the objectives, mixing, FP8, EMA.

`train_step.TrainStep` runs forward and backward over a rank's micro-batches, then the update; `model`
builds and shards the ViT, `optim` its AdamW and schedule, `objective` the loss (supervised or MAE),
`mixing` Mixup/CutMix, `fp8` float8 Linear layers, `ema` an average of the weights. It runs under Ray Train
workers, under torchrun or in one process (`jobs/benchmark.py train`): nothing here imports Ray.
"""
