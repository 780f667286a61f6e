"""`jobs/embed.py`'s command: what the job does once its command line is parsed (`pipeline.cli.main` ends it).

The job's modules load with its work (its errors' classes too, in `failures`), not with ``--help``.
"""

from __future__ import annotations

import argparse

from pipeline import cli
from pipeline.embed.config import EmbedConfig


def failures() -> tuple[type[BaseException], ...]:
    """The embedding run's own errors (a failed run, exit code 1), imported when one comes."""
    from pipeline.data.bad_samples import BadSampleBudgetError, LabelsMissingError
    from pipeline.embed.identity import OutputClaimedError
    from pipeline.embed.job import NonFiniteEmbeddingError

    return BadSampleBudgetError, LabelsMissingError, NonFiniteEmbeddingError, OutputClaimedError


def command(args: argparse.Namespace) -> int:
    """`jobs/embed.py`: the device chosen (from --gpu / --cpu, else the cluster's GPUs), the plan
    printed, Ray joined or started with room for the actors, the shards not yet committed embedded."""
    from pipeline.embed import devices, job, progress

    config = EmbedConfig(**cli.overrides(args, EmbedConfig))
    local = cli.ray_address(args) is None
    chosen = devices.choose_device(config, gpu=args.gpu, cpu=args.cpu, local=local)
    if cli.printed(args, chosen or config):
        return 0
    connected = chosen is None
    if connected:  # a joined cluster, neither --gpu nor --cpu: what it has now decides
        cli.connect_ray(args, needed_cpus=0)
        chosen = devices.gpus_from_cluster(config)
    plan = job.prepare(chosen)
    print(plan.describe(), flush=True)
    if plan.work.pending:
        if local:
            plan.config = devices.local_actor_cpus(
                plan.config, given=args.cpus_per_actor is not None, num_cpus=args.num_cpus
            )
        if not connected:
            cli.connect_ray(args, needed_cpus=devices.local_cpus_needed(plan.config))
        devices.describe_actors(plan.config)
    if connected or plan.work.pending:  # Ray joined or started: its read tasks need a labelled node
        cli.check_decode_nodes(plan.config.decode_nodes, local=local)
    cli.start_work()
    summary = job.run(plan, on_commit=progress.EmbedProgress(len(plan.work.pending)).on_commit)
    print("\n" + summary.format(), flush=True)
    if summary.failed:
        raise cli.RunFailed(summary.failure())
    return 0
