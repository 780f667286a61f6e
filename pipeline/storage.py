"""Outputs on any fsspec location (local path, s3://, gs://): joins, uploads, atomic commits.

A place in storage is one value, a `Location`: its URL and the fsspec options that reach it (endpoint,
credentials: a job's ``--storage-options``), so that the two cannot part on the way down. Every function
here takes a Location, or a plain path or URL (no options: credentials and endpoints from the
environment, AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AWS_ENDPOINT_URL ...).
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import split_protocol, url_to_fs

from pipeline.redaction import public_url
from pipeline.settings import Settings, setting


def is_local(where: Location | str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    uri = str(where)
    protocol = uri.split("://", 1)[0] if "://" in uri else None
    return protocol in (None, "file", "local")


def local_path(where: Location | str) -> str:
    """The filesystem path of a local URL (``file:///x`` -> ``/x``)."""
    uri = str(where)
    return uri.split("://", 1)[1] if "://" in uri else uri


# fsspec protocol -> the package that provides it (the `s3` and `gcs` extras of vitray).
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or URL (`Location.join` for a Location)."""
    if is_local(uri):
        return os.path.join(local_path(uri), *parts)
    return "/".join([uri.rstrip("/"), *(p.strip("/") for p in parts)])


@dataclass(frozen=True)
class Location:
    """A local path or URL with the fsspec options that reach it (``{"client_kwargs": {"endpoint_url":
    ...}, "key": ..., "secret": ...}``; none: the environment's). ``str()`` is the URL alone and
    ``repr()`` its `public_url` and the options' keys, never their values, so a Location in a log or Ray's
    record of a run's config shows no secret."""

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise TypeError(f"a Location's url is a str, not {type(self.url).__name__}")
        object.__setattr__(self, "options", dict(self.options or {}))  # None -> {}; its own copy

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        keys = f", options=<{', '.join(sorted(map(str, self.options)))}>" if self.options else ""
        return f"Location({public_url(self.url)!r}{keys})"

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def is_local(self) -> bool:
        """True for a plain path or a ``file://`` URL."""
        return is_local(self.url)

    @property
    def local_path(self) -> str:
        """The filesystem path of a local location (``file:///x`` -> ``/x``)."""
        return local_path(self.url)

    def join(self, *parts: str) -> Location:
        """The location of ``parts`` below this one, with the same options."""
        return Location(join(self.url, *parts), self.options)

    def at(self, url: str) -> Location:
        """Another URL reached with the same options (a file a listing or an expansion named)."""
        return Location(url, self.options)

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """(filesystem, path within it); a ValueError that names the package to install when the
        URL's filesystem is missing."""
        try:
            return url_to_fs(self.url, **self.options)
        except ImportError as e:
            protocol = self.url.split("://", 1)[0]
            hint = (
                f"pip install {BACKENDS[protocol]}" if protocol in BACKENDS else "install its fsspec backend"
            )
            raise ValueError(f"{protocol}:// URLs need a filesystem package: {hint} ({e})") from e


# The sections of a job's config that say how it reaches storage (`pipeline.settings`): a config takes a
# section by inheriting it, so that its fields stay flat (their flags and JSON those of any field). Every
# job that reads or writes storage takes `Storage`, a job that writes a directory `Output`; a job words a
# flag's help for itself in its config's ``HELP``.


@dataclass(frozen=True, kw_only=True)
class Storage(Settings):
    """How a job reaches what it reads and writes: fsspec options (endpoint, credentials)."""

    storage_options: dict | None = setting(
        None,
        'fsspec options as JSON, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\' '
        "(credentials: prefer the environment)",
        secret=True,
    )

    def location(self, url: str) -> Location:
        """``url`` (an input or output of the job) with ``storage_options``."""
        return Location(url, self.storage_options)


@dataclass(frozen=True, kw_only=True)
class Output(Storage):
    """`Storage`, and the directory a job writes: ``--out``, ``--overwrite``."""

    out: str = setting(help="output directory (local path, s3:// or gs://)", required=True)
    overwrite: bool = setting(False, "write into an --out that holds files this job did not write")


def as_location(where: Location | str | os.PathLike) -> Location:
    """``where`` as a Location: a plain path or URL gets no options (the environment's)."""
    return where if isinstance(where, Location) else Location(str(where))


def filesystem(where: Location | str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path within it) of a location (`Location.fs`)."""
    return as_location(where).fs()


def arrow_filesystem(where: Location | str) -> Any:
    """A pyarrow filesystem over the location's fsspec one (its options included): for libraries that
    take pyarrow's, Ray Train's storage among them."""
    import pyarrow.fs

    fs, _ = as_location(where).fs()
    return pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs))


def exists(where: Location | str) -> bool:
    fs, path = filesystem(where)
    return fs.exists(path)


def read_text(where: Location | str) -> str:
    fs, path = filesystem(where)
    with fs.open(path, "r") as f:
        return f.read()


# --- output directories: whose they are ----------------------------------------------------------


def is_root(where: Location | str) -> bool:
    """True for a filesystem root: ``/``, a drive (``C:\\``), or an object-store URL that names no bucket
    (``s3://``). A bucket itself (``s3://bucket``) is a directory like any other."""
    if is_local(where):
        path = os.path.abspath(local_path(where) or ".")
        return os.path.dirname(path) == path
    # From the URL alone: making the filesystem would connect nothing, but would cache an instance
    # holding today's environment (endpoint, credentials) for every later user of the same options.
    _, path = split_protocol(str(where))
    return not path.split("::")[0].strip("/")


def _listing(where: Location | str) -> tuple[str, list[dict[str, Any]]]:
    """(path, entries) of one fresh listing of ``where`` (the filesystem's listing cache dropped first);
    no entries where nothing is there."""
    fs, path = filesystem(where)
    fs.invalidate_cache(path)
    try:
        return path, fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return path, []


def list_entries(where: Location | str) -> dict[str, bool] | None:
    """``{name: is a directory}`` of what directory ``where`` holds, in one listing; {} when it does not
    exist, None when ``where`` is a file."""
    path, entries = _listing(where)
    base = path.rstrip("/")
    if len(entries) == 1 and entries[0]["name"].rstrip("/") == base and entries[0].get("type") == "file":
        return None
    return {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: entry.get("type") == "directory"
        for entry in entries
        if entry["name"].rstrip("/") != base
    }


def check_output_dir(
    out: Location | str, *, job: str, owns: Callable[[dict[str, bool]], bool], overwrite: bool = False
) -> None:
    """Refuse, in one line (ValueError), an output directory that is a filesystem root or a file, or that
    holds what ``job`` did not write: ``owns(entries)`` (`list_entries`) tells whether a directory that is
    not empty is the job's own (its marker, its checkpoints, only names it writes), so a run of the same
    job resumes into it. ``overwrite`` allows the latter. Costs one listing."""
    if is_root(out):
        raise ValueError(f"--out {out} is the root of a filesystem; pick a directory inside it")
    entries = list_entries(out)
    if entries is None:
        raise ValueError(f"--out {out} is a file; pick a directory")
    if not entries or overwrite or owns(entries):
        return
    names = sorted(name + ("/" if is_dir else "") for name, is_dir in entries.items())
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ValueError(
        f"--out {out} holds files {job} did not write ({shown}); pass --overwrite to write into it "
        "anyway, or pick another --out"
    )


TEMP_MARK = ".tmp-"  # in the name of every file that is not yet committed


def temporary_name(path: str | Path) -> Path:
    """Where a local file is written before it is renamed onto ``path``: a hidden name beside it,
    ``.<name>.tmp-<random>``, unique per writer, ignored by Parquet readers and by `is_temporary`."""
    path = Path(path)
    return path.parent / f".{path.name}{TEMP_MARK}{uuid.uuid4().hex[:12]}"


_TEMPORARY = re.compile(r"\..+" + re.escape(TEMP_MARK) + r"[0-9a-f]{12}")


def is_temporary(name: str) -> bool:
    """True for a name that `temporary_name` made (a file not yet committed), and for no other: a
    committed file whose own name holds ``.tmp-`` (``c.tmp-1.parquet``) is no temporary."""
    return _TEMPORARY.fullmatch(name) is not None


def write_text(where: Location | str, text: str) -> None:
    """Write a whole small file; atomic on local disk (rename), one PUT on object stores."""
    fs, path = filesystem(where)
    if is_local(where):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_name(path)
        tmp.write_text(text)
        os.replace(tmp, path)
    else:
        with fs.open(path, "w") as f:
            f.write(text)


def create_text(where: Location | str, text: str) -> bool:
    """Write a whole small file where none is; True when this call wrote it, False when one was there.

    Local: exclusive (the text goes to a temporary name that is then hard-linked onto ``where``, a link
    that fails where a file exists), so of two writers exactly one wins and no reader sees half a file;
    on a filesystem without hard links (some FUSE mounts), an ``O_EXCL`` create, exclusive as well.
    Object stores: a conditional PUT (If-None-Match) where fsspec's backend sends one (fsspec 2024.12
    and later: s3fs, gcsfs) and the store honours it; else an existence check, then a PUT, which two
    writers can both pass. A caller that needs one winner everywhere reads the file back.
    """
    fs, path = filesystem(where)
    if is_local(where):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_name(path)
        tmp.write_text(text)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            return _create_exclusive(path, text)
        finally:
            tmp.unlink()
        return True
    if "mode" in inspect.signature(fs.pipe_file).parameters:
        try:
            fs.pipe_file(path, text.encode(), mode="create")
        except FileExistsError:
            return False
        return True
    if fs.exists(path):
        return False
    fs.pipe_file(path, text.encode())
    return True


def _create_exclusive(path: str, text: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def upload_dir(
    local_dir: str | Path,
    target: Location | str,
    *,
    commit_last: str | None = None,
    attempts: int = 4,
    backoff_s: float = 1.0,
) -> None:
    """Copy a local directory's files into `target` (a directory), each file replaced whole.

    Local: copied under a temporary name, then renamed, so a reader never sees half a file (and a
    file already open, or memory-mapped, keeps its old contents). Object stores: one upload per
    file, which becomes visible only once complete; then the directory is listed, and a file that
    is missing or of another size is sent again (`attempts` rounds, `backoff_s` doubling between
    them; a listing that fails counts as nothing there), after which an OSError names it: a failed
    or silently dropped upload never passes. A `commit_last` file, the one readers take as the
    commit (an export's config.json), goes only once every other file is there, so a crash part-way
    never leaves a new commit beside old files.
    """
    target = as_location(target)
    fs, path = target.fs()
    fs.makedirs(path, exist_ok=True)
    children = sorted(Path(local_dir).iterdir(), key=lambda child: (child.name == commit_last, child.name))
    if target.is_local:
        for child in children:
            target = f"{path.rstrip('/')}/{child.name}"
            tmp = temporary_name(target)
            shutil.copyfile(child, tmp)
            os.replace(tmp, target)
        return
    rest = [child for child in children if child.name != commit_last]
    for group in (rest, [child for child in children if child.name == commit_last]):
        if group:
            _put_checked(group, target, attempts, backoff_s)


def _put_checked(files: list[Path], target: Location, attempts: int, backoff_s: float) -> None:
    """Upload `files` into directory `target` until a listing shows each whole, or raise."""
    fs, path = target.fs()
    pending, error = files, None
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        for child in pending:
            try:
                fs.put_file(str(child), f"{path.rstrip('/')}/{child.name}")
            except Exception as e:
                error = e
        try:
            present = list_files(target)
        except Exception as e:  # the store did not answer the check: check again next round
            error, present = e, {}
        pending = [child for child in pending if present.get(child.name) != child.stat().st_size]
        if not pending:
            return
    names = ", ".join(child.name for child in pending)
    raise OSError(
        f"could not upload {names} to {target} in {attempts} tries (last error: {error}); check the store"
    )


# --- whole-file commits and listings, for outputs that are resumed file by file ---------------------


def list_files(where: Location | str) -> dict[str, int]:
    """``{name: size in bytes}`` of the files directly inside directory ``where``; {} when it does not exist.

    One listing request on object stores, read fresh (the filesystem's listing cache is dropped first).
    """
    _, entries = _listing(where)
    return {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry.get("size") or 0)
        for entry in entries
        if entry.get("type") == "file"
    }


def remove(where: Location | str) -> None:
    """Delete one file; a file that is already gone is fine."""
    fs, path = filesystem(where)
    with suppress(FileNotFoundError):
        fs.rm_file(path)


@contextmanager
def staged_file(where: Location | str) -> Iterator[str]:
    """A local path to write a whole file into; on a clean exit the file appears at ``where`` complete.

    Local: the path is `temporary_name` of ``where``, renamed onto it at the end, so a reader never sees a partial file; a crash leaves only the hidden name,
    which `is_temporary` recognizes. Object stores: the path is in a local temporary directory and
    the file is uploaded in one go at the end (an object is visible only once its upload completes).
    On an exception nothing appears at ``where`` and the staged file is removed.
    """
    where = as_location(where)
    if where.is_local:
        target = Path(where.local_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = temporary_name(target)
        try:
            yield str(staged)
            os.replace(staged, target)
        finally:
            staged.unlink(missing_ok=True)
        return
    fs, path = where.fs()
    scratch = tempfile.mkdtemp(prefix="vitray-stage-")
    try:
        staged = os.path.join(scratch, path.rsplit("/", 1)[-1])
        yield staged
        fs.put_file(staged, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def local_copy(where: Location | str, files: tuple[str, ...]) -> Iterator[Path]:
    """A local directory that holds ``files`` of directory ``where``, for code that reads local files only
    (`vit.load_pretrained`): ``where`` itself when it is local, else a temporary copy of those of the files
    it has (removed on exit), fetched with its storage options."""
    where = as_location(where)
    if where.is_local:
        yield Path(where.local_path)
        return
    fs, path = where.fs()
    scratch = Path(tempfile.mkdtemp(prefix="vitray-fetch-"))
    try:
        for name in files:
            if fs.exists(f"{path.rstrip('/')}/{name}"):
                fs.get_file(f"{path.rstrip('/')}/{name}", str(scratch / name))
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
