"""Benchmarks of vitray, each measured against a baseline in the same run.

    python jobs/benchmark.py data  [--json PATH] ...   Ray Data pipeline vs webdataset + DataLoader vs decode ceiling
    python jobs/benchmark.py model [--json PATH] ...   ViT forward+backward vs transformers' ViTModel
    python jobs/benchmark.py train [--json PATH] ...   one FSDP2 training step (no Ray): images/s, MFU, memory
    python jobs/benchmark.py embed [--json PATH] ...   the embedding job vs a naive single-process loop
    python jobs/benchmark.py index [--json PATH] ...   HNSW / IVF-PQ vs exact search: build, memory, recall
    python jobs/benchmark.py checkpoint [--json PATH] ...   training stall per checkpoint: sync vs async saves
    python jobs/benchmark.py position [--json PATH] ...   host time a step of the data position: one source vs mixed
    python jobs/benchmark.py host [--json PATH] ...   the real job's host work beside a device-shaped step (CPU)
    python jobs/benchmark.py native [--json PATH] ...   native-aspect batches vs square at one token budget (CPU)

`python jobs/benchmark.py NAME --help` lists a benchmark's options. Each prints a table and, with
`--json PATH`, writes the same figures as JSON. Results and the machines they came from: BENCHMARKS.md.
The model, train and position benchmarks import no Ray, so they run on a bare GPU machine with torch alone.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# Run as a script (`python jobs/benchmark.py`): make the repository root importable, so the
# benchmarks also run from a plain checkout (PYTHONPATH unset, project not installed).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COMMANDS = {
    "data": "Ray Data pipeline vs webdataset + DataLoader vs the per-core decode ceiling",
    "model": "ViT forward+backward vs transformers' ViTModel",
    "train": "one FSDP2 training step without Ray: images/s, MFU, peak memory",
    "embed": "the embedding job vs a naive single-process loop",
    "index": "approximate indexes (HNSW, IVF-PQ) vs exact search: build time, memory, recall@10, latency",
    "checkpoint": "the training stall per checkpoint: synchronous vs asynchronous saves (pretraining runs)",
    "position": "the host time a step of the data position: one source vs sources mixed by weight",
    "host": "the real training job with its step a device-shaped wait: steps/s against the ideal, host ms",
    "native": "native-aspect batches vs square ones at one token budget: padding, tokens/s (data, step)",
}


def usage() -> str:
    lines = [f"  {name:<6} {text}" for name, text in COMMANDS.items()]
    return "usage: python jobs/benchmark.py {" + ",".join(COMMANDS) + "} [options]\n\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown benchmark {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # Imported on demand: `data`, `embed` and `checkpoint` need Ray, `model` and `train` must run without it.
    module = importlib.import_module(f"jobs.benchmarks.{name}")
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
