"""Everything that runs on Ray: the data stages, the Ray Train worker loop, the embedding stage.

Importing the package imports nothing heavy: no Ray, no torch. Modules that need Ray import it
themselves (and `pipeline.data` only inside the functions that build datasets), so that the
training step can be imported and benchmarked on a bare GPU machine without Ray installed.

Data side, in the order a sample meets it:

- `pipeline.data.shards`: shard URLs (path, dir, glob, brace range, s3://, any fsspec URL) -> a list
- `pipeline.data.tar`: tar bytes -> members -> WebDataset samples (pure Python, no Ray)
- `pipeline.data.rows`: samples -> Arrow blocks of rows {key, url, image, label, error} (no Ray)
- `pipeline.data.source`: the Ray Datasource, one read task per shard running `pipeline.rows.read_shard`
- `pipeline.data.decode`: decode -> crop -> patchify, as one batch function
- `pipeline.data`: `DataConfig`, `shard_order`, `build_dataset` (the one place that chains the stages),
  `iter_batches`
- `pipeline.data.bad_samples`: counting and budgeting the samples that could not be used
- `pipeline.data.writing`, `pipeline.data.synthetic`: writing shards, from an image folder or a generator
"""
