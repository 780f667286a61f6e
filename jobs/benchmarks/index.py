"""The index job against exact search, on one synthetic embedding output, in one run.

    python jobs/benchmark.py index [--rows 1000000] [--dim 768] [--kinds hnsw,ivfpq] [--queries 200] [--json PATH]
    python jobs/benchmark.py index --rows 400000 --dim 256 --kinds flat,ivfpq --ray-tasks 0,2   # Ray against one process

Rows: unit vectors drawn around ``--clusters`` random centres (noise of 0.7 per dimension about each),
written as an embedding output with the embedding job's own table builder (``--normalize``, float32,
files of ``--rows-per-file``). Pure isotropic noise has no near neighbours worth the name (every row is
about as far from every other), which no approximate index can find; clustered rows are closer to what a
model gives, and still harder than real embeddings, whose neighbours stand out more.

For each kind: ``jobs/index.py`` runs in its own process (build seconds and its peak resident memory,
reading included); then ``--queries`` rows, taken evenly through the output, are searched one at a time
(median latency) and all at once, and recall@10 is the share of their exact 10 nearest (a streamed
brute-force scan of the same rows, in float32) that the index returns. ``flat`` in ``--kinds`` builds
the exact index too, for its memory and latency. ``--ray-tasks 0,2`` builds each kind once per value
(``jobs/index.py --ray-tasks``; 0 is one process): ``build_s`` is the job's whole run (a local Ray's
start included), ``own_s`` the build itself as its ``_index.json`` records it (training, adding and
merging, before the files are written; ``add_s`` the adding and merging alone), and ``same`` whether ``index.faiss`` is byte
for byte the first build's of that kind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from jobs.benchmarks.report import print_table, write_json
from pipeline.embed.output import FORMAT, MANIFEST, embedding_table

ROOT = Path(__file__).resolve().parents[2]
# Runs jobs/index.py and prints its peak resident memory (KiB on Linux) on the last line.
MEASURED = (
    "import resource, runpy, sys; sys.argv = ['jobs/index.py', *sys.argv[1:]]\n"
    "try:\n    runpy.run_path('jobs/index.py', run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code\n"
    "print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)

# Ray waits 30 s (not configurable) for a new local node to register; a machine busy with other work can
# take longer, and the build is then run once more.
NO_RAY_START = "The current node timed out during startup"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmark.py index", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the output (default: %(default)s)")
    p.add_argument("--dim", type=int, default=768, help="D (default: %(default)s)")
    p.add_argument("--clusters", type=int, default=1000, help="centres the rows are drawn around")
    p.add_argument("--rows-per-file", type=int, default=50_000, help="rows per Parquet file")
    p.add_argument(
        "--kinds", default="hnsw,ivfpq", help="index kinds, comma-separated (default: %(default)s)"
    )
    p.add_argument("--memory-gb", type=float, default=8.0, help="jobs/index.py --memory-gb")
    p.add_argument(
        "--ray-tasks", default="0", help="jobs/index.py --ray-tasks values, comma-separated (default: 0)"
    )
    p.add_argument("--queries", type=int, default=200, help="rows searched for recall and latency")
    p.add_argument("--dir", help="keep the output and indexes here (default: a temporary directory)")
    p.add_argument("--json", help="also write the figures here")
    return p.parse_args(argv)


def write_output(out: Path, args: argparse.Namespace, queries: np.ndarray) -> np.ndarray:
    """Write the output file by file (never all rows in memory); returns the rows ``queries`` name."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(args.clusters, args.dim)).astype(np.float32)
    about = {"format": FORMAT, "model": {"name": "synthetic"}, "weights": {"sha256": "0" * 64}, "dim": args.dim,
             "output": {"normalize": True, "dtype": "float32"}}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    shards, found = {}, []
    for i, lo in enumerate(range(0, args.rows, args.rows_per_file)):
        n = min(args.rows_per_file, args.rows - lo)
        x = centres[rng.integers(0, args.clusters, n)] + 0.7 * rng.normal(size=(n, args.dim)).astype(
            np.float32
        )
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        url = f"synthetic-{i:05d}.tar"
        keys = [str(k) for k in range(lo, lo + n)]
        table = embedding_table(keys, [url] * n, x, np.full(n, -1), {**about, "shard": {"url": url}})
        pq.write_table(table, out / f"part-{i:05d}.parquet", compression="zstd")
        shards[url] = {"file": f"part-{i:05d}.parquet", "rows": n}
        mine = queries[(queries >= lo) & (queries < lo + n)]
        found.append(x[mine - lo])
    (out / MANIFEST).write_text(json.dumps({**about, "shards": shards}))
    return np.concatenate(found)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from pipeline.index import search

    work = Path(args.dir or tempfile.mkdtemp(prefix="vitray-bench-index-"))
    queries = np.linspace(0, args.rows - 1, args.queries).astype(np.int64)
    start = time.perf_counter()
    q = write_output(work / "emb", args, queries)
    print(f"wrote {args.rows:,} rows of D = {args.dim} in {time.perf_counter() - start:.0f} s", flush=True)
    truth = exact_top10(work / "emb", q, args.dim)
    rows, first = [], {}
    for kind, tasks in [(k, int(t)) for k in args.kinds.split(",") for t in args.ray_tasks.split(",")]:
        out = work / f"index-{kind}-{tasks}"
        cmd = [sys.executable, "-c", MEASURED, "--embeddings", str(work / "emb"), "--out", str(out)]
        cmd += ["--kind", kind, "--memory-gb", str(args.memory_gb), "--overwrite", "--ray-tasks", str(tasks)]
        for _ in range(2):
            start = time.perf_counter()
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            if NO_RAY_START not in done.stderr:
                break
            print(f"{kind}, --ray-tasks {tasks}: the local Ray did not start in time; once more", flush=True)
        if done.returncode:
            said = [line for line in done.stderr.splitlines() if line.startswith("error: ")] or ["?"]
            raise SystemExit(f"{kind}, --ray-tasks {tasks}: exit code {done.returncode}, {said[-1]}")
        peak = int(done.stderr.split("peak_kib")[-1].split()[0]) / 2**20  # GiB (the driver's, with Ray)
        with open(out / "index.faiss", "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        index = search.load_index(str(out))
        latency = []
        for row in q:
            t = time.perf_counter()
            index.search(row[None], 10)
            latency.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, got = index.search(q, 10)
        batch_ms = (time.perf_counter() - t) / len(q) * 1e3
        recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(truth, got, strict=True)]))
        rows.append({"kind": kind, "params": json.dumps(index.manifest["params"]), "ray_tasks": tasks,
                     "build_s": seconds, "own_s": index.manifest["build"]["seconds"],
                     "add_s": index.manifest["build"].get("add_seconds"),
                     "same": first.setdefault(kind, digest) == digest, "peak_gib": peak,
                     "index_gib": (out / "index.faiss").stat().st_size / 2**30,
                     "recall@10": recall, "query_ms": statistics.median(latency) * 1e3,
                     "batched_query_ms": batch_ms})  # fmt: skip
        print(done.stdout.strip(), flush=True)
    print_table(f"{args.rows:,} rows, D = {args.dim}, {args.queries} queries (exact: brute force)", rows)
    if args.json:
        write_json(args.json, {"rows": args.rows, "dim": args.dim, "results": rows})


def exact_top10(out: Path, q: np.ndarray, dim: int) -> np.ndarray:
    """Ids of each query's 10 nearest rows by inner product, scanning the output file by file."""
    from pipeline.embed.reader import OutputReader, features

    best = np.full((len(q), 10), -np.inf, np.float32)
    best_ids = np.full((len(q), 10), -1)
    seen = 0
    for batch in OutputReader.open(str(out), name="--embeddings").iter_batches(["embedding"], 65536):
        x = features(batch.column(0), dim)
        scores = np.concatenate([best, q @ x.T], 1)
        ids = np.concatenate([best_ids, np.broadcast_to(np.arange(seen, seen + len(x)), (len(q), len(x)))], 1)
        top = np.argpartition(-scores, 10, axis=1)[:, :10]
        best, best_ids = np.take_along_axis(scores, top, 1), np.take_along_axis(ids, top, 1)
        seen += len(x)
    return best_ids
