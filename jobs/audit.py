"""Check what a training run trained against its shards: every good sample of every finished epoch trained
once, the current epoch's consumed samples once; the shards with missing or repeated samples named.

    python jobs/audit.py --run /tmp/run                                          # one process, no Ray
    python jobs/audit.py --run s3://b/runs/h14 --data 's3://b/moved/train-{000000..002047}.tar' --threads 32

--run is a training run's --out: its latest complete checkpoint (or --checkpoint) holds the ledger of what
each epoch consumed, per shard (a count and a hash of the samples' keys, the bad samples apart). Each shard
of the run is read once, member headers only. Exit code 0: each sample once; 1: a shard with missing or
repeated samples (named), or one that could not be read; 2: no checkpoint or ledger, or shards that are
not the run's (pass --data with where they are now).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.train import audit


def main(argv: list[str] | None = None) -> int:
    return cli.main(audit.audit_parser(__doc__), audit.audit_command, argv)


if __name__ == "__main__":
    sys.exit(main())
