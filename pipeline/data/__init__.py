"""Shards -> uint8 patch rows, on Ray Data, without torch.

In the order a sample meets it: `shards` (URLs -> shard list), `tar` (tar bytes -> WebDataset samples),
`rows` (samples -> Arrow rows {key, url, image, label, error}), `source` (the Ray Datasource, one read
task per shard), `decode` (decode -> crop -> patchify, one batch function), `dataset` (the one place
that chains the stages, and the batches a consumer takes), `bad_samples` (counting and budgeting what
could not be used). `config` holds `DataConfig` and the seeds; `writing` and `synthetic` write shards.
"""
