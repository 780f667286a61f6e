"""Rewrite docs/options.md from the jobs' parsers (`make docs`).

    python jobs/docs.py            # rewrite docs/options.md
    python jobs/docs.py --check    # exit 1 if docs/options.md differs from the parsers

The file is written by `pipeline.reference`; tests/system/test_docs.py fails while it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import reference

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if the file differs")
    args = parser.parse_args(argv)
    path = ROOT / reference.PATH
    text = reference.markdown()
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"error: {reference.PATH} differs from the jobs' parsers; run make docs", file=sys.stderr)
            return 1
        print(f"{reference.PATH} is up to date")
        return 0
    path.write_text(text)
    print(f"wrote {reference.PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
