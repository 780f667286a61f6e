"""What a training run takes from the cluster beside its workers: the decode CPUs of each worker's data
pipeline, and where its run directory may live.

Decode CPUs are decided on the workers, at the start of every epoch, from what the cluster holds then.
The driver cannot know: on the shipped autoscaling configs (a head without CPUs for tasks,
`min_workers: 0`) it sees no CPUs at submission, and the GPU and decode nodes arrive only once the
workers ask for them. A budget frozen then would be 1 CPU per worker for the whole run.
`--data-cpus-per-worker` fixes the budget instead.

Run directory: each rank hands its checkpoint shards to Ray Train from its own node, and Ray Train
copies them into `--out`; on a local path that is the disk of whichever node the rank runs on. On
several nodes a local `--out` splits every checkpoint over several disks (a resume finds none of
them complete) and `final/` lands on a node the autoscaler may terminate. So a local `--out` on
a cluster is refused unless declared shared (`--shared-out`: the same filesystem mounted at the
same path on every node).
"""

from __future__ import annotations

import math
from typing import Any

from pipeline import storage
from pipeline.train.config import TrainConfig


def decode_cpus(config: TrainConfig, world: int, cluster_cpus: float) -> tuple[float, str]:
    """(CPUs for each worker's data pipeline, where the figure comes from): the explicit
    `data_cpus_per_worker`, else the cluster's CPUs beyond the training workers' shared out evenly
    (at least 1, so that a worker's pipeline can always make progress)."""
    if config.cluster.data_cpus_per_worker is not None:
        return float(config.cluster.data_cpus_per_worker), "--data-cpus-per-worker"
    spare = cluster_cpus - world * config.cluster.cpus_per_worker
    budget = max(1.0, float(math.floor(spare / world)))
    return budget, (
        f"{cluster_cpus:g} CPUs in the cluster now, {world} workers x {config.cluster.cpus_per_worker:g} for training"
    )


def data_cpus_per_worker(config: TrainConfig, world: int, rank: int, epoch: int) -> float:
    """The decode budget of this worker for this epoch, read from the cluster now; rank 0 logs it.

    Called by every worker at the start of each epoch, so nodes that joined since (the autoscaler's
    GPU nodes at the start, decode nodes later) count from the next epoch on.
    """
    import ray

    cpus = 0.0 if config.cluster.data_cpus_per_worker is not None else ray.cluster_resources().get("CPU", 0.0)
    budget, source = decode_cpus(config, world, cpus)
    if rank == 0 and _logged_budget.get("value") != budget:  # a line when it changes, not every epoch
        from pipeline.train.observe.metrics import log_line

        log_line(f"epoch {epoch}: {budget:g} decode CPUs per worker ({source})")
        _logged_budget["value"] = budget
    return budget


# The budget rank 0 last logged in this worker process.
_logged_budget: dict[str, float] = {}


def local_out_problem(
    config: TrainConfig, nodes: list[dict[str, Any]], worker_resources: dict[str, float]
) -> str | None:
    """Why a local `--out` cannot work on this cluster, or None.

    ``nodes``: the cluster's live nodes, each ``{"resources": {...}}`` (their total resources). A
    local `--out` is fine on an object store path, when declared shared, or on a cluster of one node
    that holds every training worker (a local Ray, or a single machine's `ray start --head`). Another
    node now, or workers that do not fit on the one node there (an autoscaling cluster whose head
    schedules nothing), means ranks on other disks.
    """
    if not storage.is_local(config.run.out) or config.cluster.shared_out:
        return None
    fix = (
        "use an object store (s3://..., gs://...) or a filesystem every node mounts at the same path, "
        "declared with --shared-out"
    )
    if len(nodes) > 1:
        return f"--out {config.run.out} is a local path, but the cluster has {len(nodes)} nodes; {fix}"
    capacity = nodes[0]["resources"] if nodes else {}
    workers = config.cluster.max_workers  # an elastic run grows onto the nodes that join
    fits = min(
        (capacity.get(name, 0.0) // amount for name, amount in worker_resources.items() if amount > 0),
        default=float(workers),
    )
    if fits < workers:
        return (
            f"--out {config.run.out} is a local path, but the {workers} workers will run on nodes "
            f"this cluster adds (its one node holds {fits:g} of them); {fix}"
        )
    return None


def worker_resources(config: TrainConfig) -> dict[str, float]:
    """What one training worker asks of Ray (the ScalingConfig's resources_per_worker)."""
    return {"CPU": config.cluster.cpus_per_worker, **({"GPU": 1.0} if config.cluster.use_gpu else {})}
