"""The embedding job: shards -> decode/patchify -> an actor pool holding the model -> one Parquet file per shard.

    shards -> build_dataset(train=False): read + decode + eval crop + patchify, CPU tasks (one per shard)
           -> map_batches(Embedder): actors that load the model once; uint8 patches (B, N, P*P*C) -> (B, D)
              (``--decode gpu``: the read tasks vet the images and leave them encoded, and the actors
              decode and crop them on their GPU first: `pipeline.embed.device_decode`)
           -> driver: rows of one shard collected until the next shard's rows arrive (the dataset keeps
              input order), then written whole, committed, and recorded in the manifest (pipeline.embed.output)

`prepare` does every check that needs no cluster (shards exist, weights load and fit ``--model``, the
first shard holds images, ``--out`` holds nothing of another model) and decides which shards are left;
`run` does the Ray part. Both are what ``jobs/embed.py`` and ``jobs/benchmark.py embed`` call.
`run_in_process` runs the same stages in this one process instead of Ray Data's tasks and actors (the
read, the eval decode, `Embedder`, the same sink and output): what a training run's checkpoint probe
embeds its probe sets with (`pipeline.evaluate.checkpoint_probe`), on the resources of its own task.

Weights travel to the actors through the object store: the driver has loaded and checked them anyway
(its one-line errors come before any shard is read), so one ``ray.put`` of float32 numpy arrays ships
them; every actor on a node reads that one shared copy without copying it (the arrays are read-only,
and inference writes no weights), and each node fetches it once, instead of every actor downloading
and converting the file (or reading a sharded checkpoint) itself.

Determinism: the eval transform has no randomness and the model actor (`pipeline.embed.actor`) runs
every forward at one fixed shape, so the same command gives the same embeddings, bit for bit on CPU.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline import storage
from pipeline.data.bad_samples import BadSamples, reason_category
from pipeline.data.config import DataConfig
from pipeline.data.dataset import build_dataset, check_shards
from pipeline.data.mixture import parse_sources
from pipeline.data.shards import distinct, expand_shards, shard_id
from pipeline.embed import device_decode, identity
from pipeline.embed.actor import Embedder, actor_memory, embedding_dim
from pipeline.embed.config import DEFAULT_LABEL_KEY, EmbedConfig
from pipeline.embed.devices import compute_identity
from pipeline.embed.output import FORMAT, MANIFEST, EmbeddingOutput, OutputPlan, embedding_table
from pipeline.model_source import ModelSource, load_model_source, pack_state_dict

UNREADABLE = "unreadable shard"  # a storage failure, maybe passing: the shard is retried by the next run


class NonFiniteEmbeddingError(RuntimeError):
    """The model gave a NaN or infinite embedding: the run stops before that shard is committed."""


@dataclass
class EmbedPlan:
    """Everything `prepare` found out: shards, the loaded model, the eval transform, what is left to do."""

    config: EmbedConfig
    shards: list[str]  # the URLs that read them; the output knows each by its name (`shard_id`)
    source: ModelSource
    data_config: DataConfig
    header: dict[str, Any]
    output: EmbeddingOutput
    work: OutputPlan

    def describe(self) -> str:
        return (
            f"{self.source.describe()}; {len(self.shards)} shards, {len(self.work.done)} already done, "
            f"{len(self.work.pending)} to embed into {self.config.out}"
        )


@dataclass
class EmbedSummary:
    """What a run did, for people (`format`) and for benchmarks."""

    out: str
    shards: int  # in the input
    committed: int  # by this run
    already_done: int  # skipped: committed by an earlier run
    failed: dict[str, str]  # url -> reason, not committed (retried by the next run)
    rows: int  # written by this run
    rows_in_output: int  # in every committed file of the output
    bad_samples: dict[str, Any]  # BadSamples.to_dict() of this run
    seconds: float  # the Ray part: from submitting the dataset to the last commit
    images_per_s: float  # samples read (good and bad) per second of the Ray part
    startup_s: float  # until the first embeddings reached the driver (actors started, model loaded)
    model: str
    dim: int
    strays: list[str]  # other Parquet files found in --out

    def failure(self) -> str | None:
        """The one line of a run that left shards failed, or None."""
        if not self.failed:
            return None
        url, why = next(iter(self.failed.items()))
        return (
            f"{len(self.failed)} of {self.shards} shards failed (first: {url}: {why}); run the same "
            "command again to retry them"
        )

    def format(self) -> str:
        reasons = ", ".join(f"{n} {r}" for r, n in self.bad_samples["by_reason"].items()) or "none"
        lines = [
            f"shards: {self.committed} embedded, {self.already_done} already done (skipped), "
            f"{len(self.failed)} failed, of {self.shards}",
            f"rows written: {self.rows} ({self.rows_in_output} in the output), {self.model}, D = {self.dim}",
            f"bad samples skipped: {self.bad_samples['bad']} ({reasons}); keys and reasons in {MANIFEST}",
            f"lost shards (no readable sample): {len(self.bad_samples.get('lost_shards', {}))}",
            f"speed: {self.images_per_s:,.1f} images/s over {self.seconds:.1f} s "
            f"({self.startup_s:.1f} s of it starting the model actors)",
            f"output: {self.out}",
        ]
        lines += [f"FAILED {url}: {reason}" for url, reason in self.failed.items()]
        if self.failed:
            lines.append("run the same command again to retry the failed shards")
        if self.strays:
            lines.append(
                f"note: {len(self.strays)} other .parquet file(s) in the output dir are not part of it"
            )
        target = f"{self.out.rstrip('/')}/*.parquet"
        lines.append(f"""read it: duckdb -c "SELECT key, label, embedding FROM '{target}' LIMIT 5\"""")
        lines.append(f"     or: python -c \"import pandas; print(pandas.read_parquet('{self.out}').head())\"")
        return "\n".join(lines)


def eval_data_config(source: ModelSource, config: EmbedConfig) -> DataConfig:
    """The model's eval transform (`ModelSource.eval_data`) with the flags of the config's `EvalOverrides`
    on top; labels optional."""
    label_key = config.label_key
    if label_key == "auto":  # the training run's where the weights carry it
        stored = source.preprocessing
        label_key = stored.get("label_key", DataConfig.label_key) if stored else DEFAULT_LABEL_KEY
    # How images become patches: the model's own unless the command line says (square or native).
    patching = {name: getattr(config, name) for name in ("patches", "max_patches") if getattr(config, name)}
    return source.eval_data(
        config,
        **patching,
        label_key=label_key,
        require_labels=False,
        num_classes=None,  # any label is kept as it is: the training run's class count is no rule here
        max_bad_fraction=config.max_bad_fraction,
        max_lost_shards=config.max_lost_shards,
        storage_options=config.storage_options,
        decode_nodes=config.decode_nodes,
    )


def check_device_decode(config: EmbedConfig, data_config: DataConfig) -> None:
    """``--decode gpu`` refused in one line where it cannot run: no GPU for the model, a resize filter it
    does not compute (nearest), no torchvision decoder."""
    if not config.use_gpu:
        raise ValueError(
            "--decode gpu decodes on the model actors' GPUs, and this run's model runs on CPU: pass --gpu "
            "(on a GPU cluster or machine), or --decode cpu"
        )
    if data_config.native:
        raise ValueError(
            "--decode gpu crops and resizes square images; native-aspect patches (--patches native, or a "
            "model trained with them) decode on CPUs: pass --decode cpu, or --patches square"
        )
    if data_config.eval_interpolation not in device_decode.FILTERS:
        raise ValueError(
            f"--decode gpu resizes with {', '.join(device_decode.FILTERS)}; this model's eval transform "
            f"uses {data_config.eval_interpolation}: pass --interpolation bicubic, or --decode cpu"
        )
    device_decode.check_available()


def prepare(config: EmbedConfig, source: ModelSource | None = None) -> EmbedPlan:
    """Every check that needs no cluster, in the order that fails cheapest first; raises ValueError.
    ``source``: the weights, loaded already (else `load_model_source` of ``config.weights``)."""
    config.validate()
    out = config.location(config.out)
    storage.check_output_dir(  # an output's manifest is written before its first commit: it marks it
        out, job="the embedding job", owns=lambda entries: MANIFEST in entries, overwrite=config.overwrite
    )
    # Several named sources (`pipeline.data.mixture`): every source's shards, each keeping its keys.
    sources = parse_sources(config.data)
    parts = [s.urls for s in sources] if sources else [config.data]
    shards = distinct(url for urls in parts for url in expand_shards(config.location(urls)))
    source = source or load_model_source(
        config.location(config.weights),
        weights_format=config.weights_format,
        model=config.model,
        image_size=config.image_size,
    )
    if config.embedding == "pre_logits" and source.config.head != "pretrain":
        raise ValueError(
            f"--embedding pre_logits needs a pretraining head; {source.describe()} has a "
            f"{source.config.head} head, whose pre-logits are the [CLS] embedding: use --embedding cls"
        )
    data_config = eval_data_config(source, config)
    if config.decode == "gpu":
        check_device_decode(config, data_config)
    check_shards(shards, data_config)
    header = {  # through JSON and back, so that it compares equal to one read from a manifest
        "format": FORMAT,
        "version": identity.VERSION,
        "model": {"name": source.config.name, "config": source.config.to_dict()},
        "weights": {"sha256": source.sha256, "source": source.kind, "path": source.path},
        "embedding": config.embedding,
        "dim": embedding_dim(source.config, config.embedding),
        "image_size": source.config.image_size,
        "preprocessing": data_config.to_dict(),
        "compute": compute_identity(config.use_gpu, config.decode),
        "output": config.output_options(),
    }
    header = json.loads(json.dumps(header))
    output = EmbeddingOutput(out, header)
    # The output knows a shard by its name: signed again, a committed shard is still done.
    work = output.plan([shard_id(url) for url in shards], overwrite=config.overwrite)
    return EmbedPlan(config, shards, source, data_config, header, output, work)


def run(plan: EmbedPlan, *, on_commit: Callable[[str, dict], None] | None = None) -> EmbedSummary:
    """Embed the shards left in ``plan`` on the connected Ray cluster; ``on_commit(url, record)`` is
    called after each shard's commit. Raises `BadSampleBudgetError` when too many samples are bad
    (shards committed until then stay committed), and `OutputClaimedError` when ``--out`` is, or becomes,
    claimed for another model's embeddings (at the start: nothing written)."""
    config, output = plan.config, plan.output
    output.start(plan.work)
    bad = BadSamples.from_config(plan.data_config)
    sink = ShardSink(plan, bad, on_commit)
    start = time.perf_counter()
    if plan.work.pending:
        import ray

        weights = ray.put(pack_state_dict(plan.source.state_dict))
        gpu_decode = config.decode == "gpu"
        read = {shard_id(url): url for url in plan.shards}  # a pending shard's name -> the URL that reads it
        pending = [read[name] for name in plan.work.pending]
        ds = build_dataset(pending, plan.data_config, train=False, encoded=gpu_decode)
        ds = ds.map_batches(
            Embedder,
            fn_constructor_kwargs={
                # In a list: Ray Data keys actors by their arguments, and the reference is resolved
                # by the actor itself.
                "weights": [weights],
                "config": plan.source.config.to_dict(),
                "pre_logits": config.embedding == "pre_logits",
                "batch_size": config.forward_batch_size(),
                "use_gpu": config.use_gpu,
                "threads": max(1, int(config.cpus_per_actor)),
                "decode_config": plan.data_config if gpu_decode else None,
            },
            batch_size=config.forward_batch_size(),
            batch_format="numpy",
            zero_copy_batch=True,
            compute=ray.data.ActorPoolStrategy(size=config.concurrency),
            num_cpus=config.cpus_per_actor,
            num_gpus=1 if config.use_gpu else 0,
            # Declaring the actor's memory is right for scheduling, and it also keeps decoding in its
            # own CPU tasks: Ray fuses a task map into a following actor pool when their resource
            # requests are equal, which would put the decode on the model's actor.
            memory=actor_memory(
                plan.source.config, config.forward_batch_size(), config.use_gpu, plan.data_config.patch_budget
            ),
        )
        # No prefetch: Ray's prefetcher holds back blocks until its buffer is full, which delays every
        # commit (and so what a crash keeps); the executor computes ahead in its own thread anyway.
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
            sink.add(batch)
    sink.close()
    output.finish()
    bad.check_budget(final=True)
    return summary(plan, sink, bad, start)


def run_in_process(plan: EmbedPlan) -> EmbedSummary:
    """`run`'s stages in this process, shard after shard: `read_shard`, the eval decode
    (`preprocess_batch`), an `Embedder` holding the model (its ``--cpus-per-actor`` torch threads, its GPU
    with ``--gpu``), the same `ShardSink` and output; no Ray. The same rows, files and manifest as `run`
    (`Embedder` pads every forward to one shape), with the same errors. ``--decode gpu`` is `run`'s only."""
    import torch

    config, output, data = plan.config, plan.output, plan.data_config
    if config.decode != "cpu":
        raise ValueError("run_in_process decodes on this process's CPU: --decode cpu")
    output.start(plan.work)
    bad = BadSamples.from_config(data)
    sink = ShardSink(plan, bad, None)
    start, threads = time.perf_counter(), torch.get_num_threads()
    try:  # the Embedder sets the process's torch threads (--cpus-per-actor); the caller's come back after
        embed_pending(plan, sink, data)
    finally:
        torch.set_num_threads(threads)
    sink.close()
    output.finish()
    bad.check_budget(final=True)
    return summary(plan, sink, bad, start)


def embed_pending(plan: EmbedPlan, sink: ShardSink, data: DataConfig) -> None:
    """`run_in_process`'s work: each pending shard read, decoded and embedded into ``sink``."""
    from pipeline.data.decode import preprocess_batch
    from pipeline.data.rows import read_shard

    config = plan.config
    if plan.work.pending:
        embedder = Embedder(
            [pack_state_dict(plan.source.state_dict)],
            plan.source.config.to_dict(),
            pre_logits=config.embedding == "pre_logits",
            batch_size=config.forward_batch_size(),
            use_gpu=config.use_gpu,
            threads=max(1, int(config.cpus_per_actor)),
        )
        read = {shard_id(url): url for url in plan.shards}
        for name in plan.work.pending:
            for table in read_shard(data.location(read[name]), data.row_spec, data.block_rows, data.retry):
                rows = {
                    column: table.column(column).to_numpy(zero_copy_only=False)
                    for column in table.column_names
                }
                sink.add(embedder(preprocess_batch(rows, config=data, train=False, epoch=0)))


def summary(plan: EmbedPlan, sink: ShardSink, bad: BadSamples, start: float) -> EmbedSummary:
    """What a run that began at ``start`` (`time.perf_counter`) did, once its sink is closed."""
    seconds = time.perf_counter() - start
    return EmbedSummary(
        out=plan.config.out,
        shards=len(plan.shards),
        committed=sink.committed,
        already_done=len(plan.work.done),
        failed=dict(plan.output.failed),
        rows=sink.rows,
        rows_in_output=sum(r["rows"] for r in plan.output.shards.values()),
        bad_samples=bad.to_dict(),
        seconds=seconds,
        images_per_s=bad.total / seconds if seconds > 0 else 0.0,
        startup_s=(sink.first_rows_at - start) if sink.first_rows_at else 0.0,
        model=plan.source.config.name,
        dim=plan.header["dim"],
        strays=plan.work.strays,
    )


class ShardSink:
    """Driver side: rows arrive shard by shard in input order; a shard is complete once a row of a later
    shard arrives (or the stream ends), and is then written whole and committed."""

    def __init__(self, plan: EmbedPlan, bad: BadSamples, on_commit: Callable[[str, dict], None] | None):
        self.shards = plan.work.pending
        self.order = {url: i for i, url in enumerate(self.shards)}
        self.names = plan.work.names
        self.output, self.header, self.bad, self.on_commit = plan.output, plan.header, bad, on_commit
        self.current = 0  # index of the shard whose rows are being collected
        self.parts: list[dict[str, np.ndarray]] = []
        self.skipped: list[dict[str, str]] = []
        self.committed = self.rows = 0
        self.first_rows_at: float | None = None  # perf_counter() when the first batch arrived

    def add(self, batch: dict[str, np.ndarray]) -> None:
        """Take a batch of embedding rows ``{key, url, embedding (B, D), label, error}``."""
        if self.first_rows_at is None:
            self.first_rows_at = time.perf_counter()
        # Bad samples are counted, by reason, for the budget and the summary; a shard that could not be
        # read is no sample: it is reported as failed and retried by the next run instead.
        errors = batch["error"]
        unreadable = np.fromiter((reason_category(e) == UNREADABLE for e in errors), bool, len(errors))
        self.bad.filter({k: v[~unreadable] for k, v in batch.items()} if unreadable.any() else batch)
        self.bad.check_budget()
        urls = batch["url"]
        cuts = [0, *(np.flatnonzero(urls[1:] != urls[:-1]) + 1).tolist(), len(urls)]
        for lo, hi in itertools.pairwise(cuts):
            index = self.order.get(str(urls[lo]))
            if index is None or index < self.current:
                raise RuntimeError(
                    f"rows of {urls[lo]} arrived out of shard order; the output would be wrong"
                )
            while self.current < index:
                self._finish()
            errors = batch["error"][lo:hi]
            good = np.fromiter((not e for e in errors), dtype=bool, count=hi - lo)
            for key, reason in zip(batch["key"][lo:hi][~good], errors[~good], strict=True):
                self.skipped.append({"key": str(key), "reason": str(reason)})
            if good.any():
                part = {k: batch[k][lo:hi][good] for k in ("key", "embedding", "label")}
                self._check_finite(part, str(urls[lo]))
                self.parts.append(part)

    def _check_finite(self, part: dict[str, np.ndarray], url: str) -> None:
        # A NaN row is never written: finite weights can still overflow (in bf16 most of all), and every
        # later reader (k-NN, probes) would take NaN distances for answers.
        finite = np.isfinite(part["embedding"]).all(axis=1)
        if not finite.all():
            precision = self.header["compute"]["precision"]
            hint = ", or embed in fp32 with --cpu (bf16 overflows sooner)" if precision == "bf16" else ""
            raise NonFiniteEmbeddingError(
                f"the model gave NaN or infinite embeddings for {int((~finite).sum())} image(s) of {url} "
                f"(first: key {str(part['key'][~finite][0])!r}, in {precision}); nothing of that shard was "
                f"committed: check the weights (from a run that diverged?){hint}"
            )
        if self.header["output"] == {"normalize": False, "dtype": "float16"}:
            too_large = (np.abs(part["embedding"]) > np.finfo(np.float16).max).any(axis=1)
            if too_large.any():  # float16 would store them as inf
                raise NonFiniteEmbeddingError(
                    f"{int(too_large.sum())} embedding(s) of {url} hold values beyond float16's range "
                    f"(first: key {str(part['key'][too_large][0])!r}); nothing of that shard was committed: "
                    "pass --normalize (unit rows fit float16) or --dtype float32"
                )

    def close(self) -> None:
        """The stream ended: every remaining shard is complete (a shard with no rows gets an empty file)."""
        while self.current < len(self.shards):
            self._finish()

    def _finish(self) -> None:
        url = self.shards[self.current]
        parts, skipped = self.parts, self.skipped
        self.parts, self.skipped = [], []
        self.current += 1
        unreadable = [s["reason"] for s in skipped if reason_category(s["reason"]) == UNREADABLE]
        if unreadable:
            self.output.fail(url, unreadable[0])
            return
        dim = self.header["dim"]
        keys = [str(k) for p in parts for k in p["key"]]
        embeddings = (
            np.concatenate([p["embedding"] for p in parts]) if parts else np.zeros((0, dim), np.float32)
        )
        labels = np.concatenate([p["label"] for p in parts]) if parts else np.zeros(0, np.int64)
        about = {**self.header, "shard": {"url": url, "rows": len(keys), "skipped": skipped}}
        table = embedding_table(keys, [url] * len(keys), embeddings, labels, about, **self.header["output"])
        record = self.output.commit(url, self.names[url], table, skipped)
        self.committed += 1
        self.rows += len(keys)
        if self.on_commit is not None:
            self.on_commit(url, record)
