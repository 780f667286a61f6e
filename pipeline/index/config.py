"""What an index build or a search is: two frozen dataclasses that ``jobs/index.py`` and ``jobs/search.py`` fill."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from pipeline import cli
from pipeline.settings import setting
from pipeline.storage import Output, Storage

KINDS = ("auto", "flat", "ivfpq", "hnsw")
MAX_KNOB = 2**31 - 1  # --k, --nprobe, --ef-search: FAISS takes them as C ints (beyond: OverflowError)


@dataclass(frozen=True)
class IndexConfig(Output):
    """One index build; ``jobs/index.py`` maps its flags onto it field by field. Its storage and output
    section is every job's (`pipeline.storage.Output`)."""

    HELP: ClassVar[dict[str, str]] = {
        "out": "index directory (local path, s3:// or gs://)",
        "overwrite": "replace what --out holds (an index of another output, other files)",
    }

    embeddings: str = setting(
        help="embedding output(s) of one model (jobs/embed.py's --out, local or s3://), comma-separated",
        required=True,
    )
    kind: str = setting(
        "auto",
        "flat: exact; ivfpq: compressed codes (fits a memory budget); hnsw: a graph over the full vectors; "
        "auto: flat up to 50,000 rows, else hnsw where it fits --memory-gb, else ivfpq",
        choices=KINDS,
    )
    memory_gb: float = setting(  # a million GiB: a thousand of today's largest hosts
        8.0, "memory the index may take while it is built and searched (GiB)", gt=0, le=1e6
    )
    batch_rows: int = setting(
        65536, "rows read from the Parquet files at a time (streamed, never all at once)", ge=1, le=MAX_KNOB
    )
    ray_tasks: int = setting(
        0,
        "add the rows in this many Ray tasks, each a group of the output's files, after training once here "
        "(flat or ivfpq: --kind auto skips hnsw); 0: all in this process, no Ray",
        metavar="N",
        ge=0,
        le=65_536,
    )

    def validate(self) -> None:
        super().validate()
        if self.ray_tasks and self.kind == "hnsw":
            raise ValueError(
                "--ray-tasks cannot build an hnsw index (a graph does not merge from parts); pass --kind "
                "ivfpq or --kind flat, or leave out --ray-tasks"
            )


@dataclass(frozen=True)
class SearchConfig(Storage):
    """One search; ``jobs/search.py`` maps its flags onto it (``--key`` repeats: `search_parser`)."""

    index: str = setting(help="index directory that jobs/index.py wrote", required=True)
    keys: tuple[str, ...] = setting((), "keys of indexed rows to query with", flag=None)
    image: str | None = setting(None, "an image file to query with (embedded with the index's own model)")
    weights: str | None = setting(None, "the weights the indexed output was embedded with (for --image)")
    k: int = setting(10, "neighbours per query (and per row with --near-duplicates)", ge=1, le=MAX_KNOB)
    near_duplicates: float | None = setting(
        None,
        "write every pair of rows at least this similar (cosine, normalized outputs) or at most this far "
        "(L2 distance, others) to --out, among each row's --k nearest",
        metavar="THRESHOLD",
        ge=-1,  # a cosine similarity's least
        le=1e6,  # an L2 distance past any two embeddings' (their norms are tens)
    )
    out: str | None = setting(None, "Parquet file for --near-duplicates pairs (local, s3://, gs://)")
    nprobe: int | None = setting(
        None, "ivfpq: inverted lists visited per query (none: the index's)", ge=1, le=MAX_KNOB
    )
    ef_search: int | None = setting(
        None, "hnsw: candidates kept per query (none: the index's)", ge=1, le=MAX_KNOB
    )

    def validate(self) -> None:
        super().validate()
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
