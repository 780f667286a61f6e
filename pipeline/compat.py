"""The one module that touches private APIs of other libraries (torch, fsspec, Ray).

Each shim names what it needs, why no public API gives it, and what it relies on; when a library
changes, this file is the one place to mend. A boundary test keeps private names out of every other
module of `pipeline/`.
"""

from __future__ import annotations

import logging
from typing import Any


def strip_protocol(fs: Any, url: str) -> str:
    """The path of ``url`` inside filesystem ``fs`` (``s3://b/k`` -> ``b/k``), without touching storage.

    fsspec's `url_to_fs` returns the path too, but builds a filesystem per call; a brace range of
    100k shards is expanded against one filesystem instance.
    """
    return fs._strip_protocol(url)


def fsspec_checkpoint_reader() -> type:
    """torch's DCP reader for fsspec URLs: not exported from `torch.distributed.checkpoint`, but the
    one DCP itself uses for ``checkpoint_id`` URLs."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """Where a DCP `FileSystemReader` (or its fsspec subclass) finds ``.metadata``: the path its own
    `read_metadata` opens, which ours must open too when it swaps in a restricted unpickler."""
    return reader._get_metadata_path(rank)


def dcp_stage(stager: Any, state_dict: Any, **kwargs: Any) -> Any:
    """DCP's own staging of ``state_dict`` by ``stager``, a `DefaultStager` (its ``_stage``: the copy
    itself, which the public ``stage`` submits to the stager's thread). `pipeline.train.checkpointing.saver.KeptStager`
    overrides ``_stage`` to refill its buffers and runs DCP's for a state laid out anew; it relies on
    ``_stage(state_dict, **kwargs)``, on the stager's ``_config``, ``_staging_stream`` and
    ``_state_dict_stager`` (torch 2.11 to 2.13)."""
    from torch.distributed.checkpoint.staging import DefaultStager

    return DefaultStager._stage(stager, state_dict, **kwargs)


def forget_compiled_graphs() -> None:
    """Drop every graph torch.compile has made in this process. Dynamo keys its caches by code object,
    so a second model of the same class counts as a recompile of the first (`torch._dynamo.reset` is
    the one documented way to start afresh)."""
    import torch._dynamo

    torch._dynamo.reset()


def parser_options(parser: Any) -> list[Any]:
    """The argparse actions of ``parser`` that are options, ``--help`` left out, in the order they were
    added. argparse keeps them in ``_actions`` and has no public way to list them; the options reference
    (`jobs/docs.py`) is written from them."""
    import argparse

    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def foreach_lerp_(tensors: list[Any], ends: list[Any], weight: float) -> None:
    """``t.lerp_(end, weight)`` for every pair, in one multi-tensor kernel per device and dtype: the
    kernel torch.optim's own ``foreach`` steps use. There is no public way to apply one op to a list of
    tensors, and a ViT-H's 390 parameters would otherwise cost 390 launches per update."""
    import torch

    torch._foreach_lerp_(tensors, ends, weight)


def filter_forwarded_logs(name: str, handle: Any) -> None:
    """Call ``handle(batch)`` on every batch of lines Ray forwards from its processes to this driver,
    before Ray prints it: the batch is a dict whose ``lines`` ``handle`` may replace, beside ``pid``,
    ``ip`` and ``is_err``. Ray's one public filter, ``RAY_DEDUP_LOGS_SKIP_REGEX``, judges each line
    alone, so the traceback a log record carries after its message cannot go with it. The driver's
    `global_worker_stdstream_dispatcher` calls its handlers in order with the same batch, its printer
    (added by ``ray.init``) among them; ``handle`` goes first, once per ``name``."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    with dispatcher._lock:
        dispatcher.handlers = [(name, handle)] + [pair for pair in dispatcher.handlers if pair[0] != name]


def ray_train_preemption_info() -> Any | None:
    """This Ray Train worker's copy of Ray's preemption notice (a `ray.train.PreemptionInfo`: the
    deadline, the preempted nodes' ranks), or None: none yet, or not in a Ray Train worker.

    Ray Train's own watcher actor polls the cluster's node drains and hands every worker of the run
    the notice (`RayTrainWorker.mark_preempt`), which lands in the worker's train context. The public
    `ray.train.get_preemption_info()` returns rank 0's copy through a barrier on an actor: every rank
    must call it equally often, a round trip each time. Read here, locally, the notice costs nothing,
    and the ranks settle it in the step's own agreement (`pipeline.train.state.agree_on_step`).
    """
    try:
        from ray.train.v2._internal.execution.context import get_train_context
    except ImportError:  # Ray Train v1: no preemption notices
        return None
    try:
        context = get_train_context()
    except RuntimeError:  # not a Ray Train worker (a test's process, plain torch.distributed)
        return None
    return context.preemption_context.preemption_info


def is_ray_console_handler(handler: logging.Handler) -> bool:
    """Whether ``handler`` is Ray's console handler (``ray._private.log.PlainRayHandler``), the one that
    ``import ray`` puts on the ``ray`` logger and ``import ray.data`` on ``ray.data``. On the driver it
    writes to the ``sys.stderr`` of the moment it was made, although its docstring says the moment of
    each record. Told by its name, so that asking imports no Ray."""
    kind = type(handler)
    return kind.__module__ == "ray._private.log" and kind.__name__ == "PlainRayHandler"


class _DropTracebacksOf(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def drop_ray_train_tracebacks(error: type[BaseException]) -> None:
    """Ray Train logs the traceback of every exception that ends a worker's training function at ERROR,
    on every rank ("Error in training function", logger `ray.train.v2._internal.util`, whatever the run's
    LoggingConfig says). For ``error``, an ending the worker loop has told in its own line, those are two
    screens of noise per restart: this process's logger drops them (once, however often called)."""
    logger = logging.getLogger("ray.train.v2._internal.util")
    text = f"{error.__module__}.{error.__qualname__}: "
    if not any(isinstance(f, _DropTracebacksOf) and f.text == text for f in logger.filters):
        logger.addFilter(_DropTracebacksOf(text))


def wait_for_ray_train_reports(timeout_s: float) -> bool:
    """Until Ray Train's controller has taken every report this worker made, the checkpoints among them
    handed over for registration; False at ``timeout_s``; True at once outside a Ray Train worker.

    The controller takes one report per worker per poll, and acts on a worker's error in the poll that
    sees it: a worker that raises with reports still queued (an asynchronous upload's report lands in
    the queue after the upload) loses them, and the restart resumes from the checkpoint before. Ray
    Train's upload pool runs its tasks in order on one thread, so an empty task queued behind them ends
    after every earlier report is queued; the queue's unfinished count falls as the controller takes them.
    """
    import contextlib
    import time

    try:
        from ray.train.v2._internal.execution.context import get_train_context
    except ImportError:
        return True
    try:
        context = get_train_context()
    except RuntimeError:
        return True
    deadline = time.monotonic() + timeout_s
    # A timeout, or a pool shut down: the queue below says the rest.
    with contextlib.suppress(Exception):
        context.checkpoint_upload_threadpool.submit(lambda: None).result(timeout=timeout_s)
    queued = context.execution_context.result_queue
    while queued.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.05)
    return not queued.unfinished_tasks


def thread_frame(ident: int) -> Any | None:
    """The innermost frame of thread ``ident`` now, or None once it has ended (CPython's
    ``sys._current_frames``; `pipeline.train.observe.stacks` samples the training thread with it)."""
    import sys

    return sys._current_frames().get(ident)


def thread_frames() -> dict[int, Any]:
    """Every thread's innermost frame now, by thread ident (CPython's ``sys._current_frames``; the hang
    watchdog, `pipeline.train.observe.watchdog`, writes each thread's stack from them)."""
    import sys

    return dict(sys._current_frames())


def default_store() -> Any | None:
    """The key-value store of the default process group (a TCPStore under Ray Train and ``tcp://``
    init), or None where there is none: the hang watchdog's ranks meet there while every collective may
    be stuck (torch's ``distributed_c10d._get_default_store``)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # no default group, or one made without a store
        return None


def exit_now(code: int) -> None:
    """End this process at once with ``code``, running no cleanup (``os._exit``): a hung rank's training
    thread may be stuck where no exception reaches, and Ray Train restarts its group from a checkpoint."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
