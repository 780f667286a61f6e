"""What a trained model learned, and how good its embeddings are: the analyze and evaluate jobs.

`config` holds the two jobs' frozen configs, `command` what each job script runs. The evaluate job
(`evaluation`) reads embedding outputs (`pipeline.embed.reader`) and scores them with a linear probe, k-NN
and the paper's few-shot linear regression (`probes`); `checkpoint_probe` scores a training checkpoint
as the embed and evaluate jobs would, in one process, for a training run's probe beside its workers. The analyze job (`inspection`) runs one process, no Ray: it reads a few images from shards
(`samples`), computes the paper's Fig. 7 quantities (`analysis`: patch-embedding filters, position
embedding similarity; `attention`: mean attention distance) and draws them (`figures`).

This room reads what the embed room writes and loads weights the way it does; it never imports
pipeline.train.
"""
