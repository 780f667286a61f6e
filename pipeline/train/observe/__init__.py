"""What a run shows of itself: metrics windows and rows, their sinks, the training thread's stacks, MFU.

`metrics` sums a logging window on the device and reduces it into one `metrics.jsonl` row; `sinks` sends
rows to TensorBoard or W&B; `stacks` samples where the training thread is; `mfu` turns images per second
into model FLOPs utilization. Imports the top of train/ (config, state) and nothing of the loop.
"""
