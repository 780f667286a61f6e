"""The embedding job: a trained model over shards -> one Parquet file of embeddings per shard.

`config` (EmbedConfig) says what a run is and `command` what `jobs/embed.py` does with it;
`pipeline.model_source` resolves and loads --weights; `job` checks everything before cluster work
(`prepare`) and runs the Ray Data pipeline (`run`) into the model actors (`actor`, placed by `devices`),
committing each shard's file and its record (`output`) into an output claimed for one model, weights and
preprocessing (`identity`), with a progress line (`progress`). The outputs are read back beside where they
are written (`reader`), by the evaluate and index jobs.
"""
