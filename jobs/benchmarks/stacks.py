"""Where the training thread's time went in each log window, from `pipeline.train.observe.stacks` samples.

    VITRAY_SAMPLE_STACKS=/tmp/stacks python jobs/pretrain.py ...
    python jobs/benchmarks/stacks.py /tmp/stacks/stacks-rank0.tsv [--top 3]

One row per log window (the samples between two reports): its seconds, the share of samples in each
part of the loop (`data wait`: waiting for the next step's input; `step`: forward, backward and
update; `report`: reports and checkpoints; `other`), the frames most often innermost in `other`, and
the longest gap between two samples (a time no sample could be taken: the interpreter lock held).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script: make the repository root importable from a plain checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.train.observe.stacks import table, windows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tsv", help="a stacks-rank<R>.tsv written under VITRAY_SAMPLE_STACKS")
    p.add_argument("--top", type=int, default=3, help="frames shown for `other` (default: %(default)s)")
    args = p.parse_args(argv)
    path = Path(args.tsv)
    if not path.is_file():
        print(
            f"error: no file {path}; run with VITRAY_SAMPLE_STACKS=DIR and pass DIR/stacks-rank0.tsv",
            file=sys.stderr,
        )
        return 2
    print(table(windows(path.read_text().splitlines()), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
