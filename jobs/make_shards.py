"""Write WebDataset shards from an image folder or from the synthetic class generator.

    python jobs/make_shards.py --synthetic 512 --out /tmp/shards
    python jobs/make_shards.py --from-folder /data/imagenet/train --out /data/shards/train --samples-per-shard 1000

Each sample is ``<key>.jpg`` (or .png / .webp), ``<key>.cls`` (the class index as text) and
``<key>.json`` (``{"label", "class", ...}``); shards are ``<prefix>-000000.tar``, ... . The last line
printed is the brace-range URL to pass as ``--data``. The same arguments write the same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout, too

from pipeline import cli
from pipeline.data import make_shards


def main(argv: list[str] | None = None) -> int:
    return cli.main(make_shards.parser(__doc__), make_shards.command, argv)


if __name__ == "__main__":
    sys.exit(main())
