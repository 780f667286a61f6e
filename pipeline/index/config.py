"""What an index build or a search is: two frozen dataclasses that ``jobs/index.py`` and ``jobs/search.py`` fill."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pipeline import cli
from pipeline.settings import setting
from pipeline.storage import Location

KINDS = ("auto", "flat", "ivfpq", "hnsw")
MAX_KNOB = 2**31 - 1  # --k, --nprobe, --ef-search: FAISS takes them as C ints (beyond: OverflowError)


@dataclass(frozen=True)
class IndexConfig:
    """One index build; ``jobs/index.py`` maps its flags onto it field by field."""

    embeddings: str = setting(
        help="embedding output(s) of one model (jobs/embed.py's --out, local or s3://), comma-separated"
    )
    out: str = setting(help="index directory (local path, s3:// or gs://)")
    kind: str = setting(
        "auto",
        "flat: exact; ivfpq: compressed codes (fits a memory budget); hnsw: a graph over the full vectors; "
        "auto: flat up to 50,000 rows, else hnsw where it fits --memory-gb, else ivfpq",
        choices=KINDS,
    )
    memory_gb: float = setting(8.0, "memory the index may take while it is built and searched (GiB)")
    batch_rows: int = setting(
        65536, "rows read from the Parquet files at a time (streamed, never all at once)"
    )
    overwrite: bool = setting(False, "replace what --out holds (an index of another output, other files)")
    ray_tasks: int = setting(
        0,
        "add the rows in this many Ray tasks, each a group of the output's files, after training once here "
        "(flat or ivfpq: --kind auto skips hnsw); 0: all in this process, no Ray",
        metavar="N",
    )
    storage_options: dict | None = setting(
        None, "fsspec options as JSON (credentials: prefer the environment)", secret=True
    )

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        if self.ray_tasks < 0:
            raise ValueError(f"--ray-tasks must be 0 (no Ray) or more, got {self.ray_tasks}")
        if self.ray_tasks and self.kind == "hnsw":
            raise ValueError(
                "--ray-tasks cannot build an hnsw index (a graph does not merge from parts); pass --kind "
                "ivfpq or --kind flat, or leave out --ray-tasks"
            )
        for name in ("embeddings", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.memory_gb <= 0 or self.batch_rows <= 0:
            raise ValueError("--memory-gb and --batch-rows must be positive")

    def location(self, url: str) -> Location:
        """``url`` with ``storage_options``."""
        return Location(url, self.storage_options)


@dataclass(frozen=True)
class SearchConfig:
    """One search; ``jobs/search.py`` maps its flags onto it (``--key`` repeats: `search_parser`)."""

    index: str = setting(help="index directory that jobs/index.py wrote")
    keys: tuple[str, ...] = setting((), "keys of indexed rows to query with", flag=None)
    image: str | None = setting(None, "an image file to query with (embedded with the index's own model)")
    weights: str | None = setting(None, "the weights the indexed output was embedded with (for --image)")
    k: int = setting(10, "neighbours per query (and per row with --near-duplicates)")
    near_duplicates: float | None = setting(
        None,
        "write every pair of rows at least this similar (cosine, normalized outputs) or at most this far "
        "(L2 distance, others) to --out, among each row's --k nearest",
        metavar="THRESHOLD",
    )
    out: str | None = setting(None, "Parquet file for --near-duplicates pairs (local, s3://, gs://)")
    nprobe: int | None = setting(None, "ivfpq: inverted lists visited per query (none: the index's)")
    ef_search: int | None = setting(None, "hnsw: candidates kept per query (none: the index's)")
    storage_options: dict | None = setting(
        None, "fsspec options as JSON (credentials: prefer the environment)", secret=True
    )

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        if not self.index:
            raise ValueError("--index is required")
        queries = sum([bool(self.keys), self.image is not None, self.near_duplicates is not None])
        if queries != 1:
            raise ValueError(
                "pass one of --key K (repeatable), --image FILE --weights W, --near-duplicates T"
            )
        if self.image is not None and not self.weights:
            raise ValueError("--image needs --weights: the weights the indexed output was embedded with")
        if self.near_duplicates is not None and not (self.out or "").endswith(".parquet"):
            raise ValueError("--near-duplicates needs --out FILE.parquet for the pairs")
        if self.out and self.near_duplicates is None:
            raise ValueError(
                "--out is where --near-duplicates writes its pairs; a query prints, so drop --out"
            )
        if self.weights and self.image is None:
            raise ValueError(
                "--weights embeds an --image query; a --key or --near-duplicates search needs none"
            )
        for flag, value in (("--k", self.k), ("--nprobe", self.nprobe), ("--ef-search", self.ef_search)):
            if value is not None and not 0 < value <= MAX_KNOB:
                raise ValueError(f"{flag} must be from 1 to {MAX_KNOB:,}, got {value:,}")

    def location(self, url: str) -> Location:
        """``url`` with ``storage_options``."""
        return Location(url, self.storage_options)


def index_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/index.py`'s command line: the settings, and Ray's flags for ``--ray-tasks``."""
    return cli.job_parser(
        "jobs/index.py", description, IndexConfig, defaults=IndexConfig(embeddings="", out="")
    )


def search_parser(description: str | None = None) -> argparse.ArgumentParser:
    """`jobs/search.py`'s command line (one process, no Ray): the settings, and ``--key`` repeated."""
    parser = cli.job_parser(
        "jobs/search.py", description, SearchConfig, defaults=SearchConfig(index=""), ray=False
    )
    parser.add_argument(
        "--key",
        dest="keys",
        action="append",
        metavar="K",
        help="key of an indexed row to query with (repeat it)",
    )
    return parser
