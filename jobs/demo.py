"""The quickstart demo (`make demo`): the whole pipeline, locally on CPU, on generated data.

Writes a small synthetic shard set, pretrains the `tiny` preset with 2 FSDP2 workers on a local
Ray, extracts CLS embeddings to Parquet, and prints where everything is. Each stage runs the same
command a user would type, so what works here works on a cluster with other flags.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

JOBS = Path(__file__).resolve().parent


def run_stage(title: str, script: str, args: list[str]) -> bool:
    """Run `python jobs/<script> <args>`; False (and a note) when that stage is not there yet."""
    path = JOBS / script
    print(f"\n=== {title}: python jobs/{script} {' '.join(args)}", flush=True)
    if not path.exists():
        print(f"    (not there yet: jobs/{script} has not landed; skipping)")
        return False
    start = time.perf_counter()
    subprocess.run([sys.executable, str(path), *args], check=True)
    print(f"    done in {time.perf_counter() - start:.0f}s")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="demo-output", help="where the demo writes everything (default: %(default)s)"
    )
    parser.add_argument(
        "--samples", type=int, default=512, help="synthetic images to generate (default: %(default)s)"
    )
    args = parser.parse_args()

    out = Path(args.out).resolve()
    shards = out / "shards"
    run_stage(
        "1/3 write synthetic shards",
        "make_shards.py",
        ["--synthetic", str(args.samples), "--out", str(shards)],
    )
    run_stage(
        "2/3 pretrain (tiny preset, 2 FSDP2 workers)",
        "pretrain.py",
        ["--preset", "tiny", "--data", str(shards), "--out", str(out / "run")],
    )
    run_stage(
        "3/3 extract embeddings",
        "embed.py",
        ["--data", str(shards), "--weights", str(out / "run" / "final"), "--out", str(out / "embeddings")],
    )
    print(f"\nEverything is under {out}")


if __name__ == "__main__":
    main()
