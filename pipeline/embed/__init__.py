"""The embedding job: a trained model over shards -> one Parquet file of embeddings per shard.

`config` (EmbedConfig) says what a run is; `weights` resolves and loads --weights; `job` checks
everything before cluster work (`prepare`) and runs the Ray Data pipeline (`run`) into the model actors
(`actor`), committing each shard's file and its record (`output`) into an output claimed for one model,
weights and preprocessing (`identity`).
"""
