"""Write WebDataset shards from an image folder or from the synthetic class generator.

    python jobs/make_shards.py --synthetic 512 --out /tmp/shards
    python jobs/make_shards.py --from-folder /data/imagenet/train --out /data/shards/train --samples-per-shard 1000

Each sample is ``<key>.jpg`` (or .png / .webp), ``<key>.cls`` (the class index as text) and
``<key>.json`` (``{"label", "class", ...}``); shards are ``<prefix>-000000.tar``, ... . The last line
printed is the brace-range URL to pass as ``--data``. The same arguments write the same bytes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout, too

from pipeline import cli
from pipeline.data.make_shards import make_shards, parse_args
from pipeline.data.writing import ShardSet, brace_url


def main(argv: list[str] | None = None) -> ShardSet:
    """Write the shards; bad input is one line and exit code 2, a failed write one line and 1."""
    args = parse_args(sys.argv[1:] if argv is None else argv, __doc__)
    start = time.perf_counter()
    written: list[ShardSet] = []

    def body() -> int:
        written.append(make_shards(args, start_work=cli.start_work))
        return 0

    code = cli.run_job(body)
    if code:
        sys.exit(code)
    shard_set = written[0]
    print(
        f"wrote {len(shard_set.urls)} shards ({len(shard_set.keys)} samples, {shard_set.num_classes} classes"
        + (f", {len(shard_set.skipped)} unreadable file(s) skipped" if shard_set.skipped else "")
        + f") to {Path(args.out).resolve()} in {time.perf_counter() - start:.1f}s; use:"
    )
    print(f"  --data '{brace_url(shard_set.urls)}'")
    return shard_set


if __name__ == "__main__":
    main()
