"""What a job's console shows: vitray's own lines, and the Ray warnings and errors a user must act on.

Left to its defaults, Ray forwards to the driver every line its processes print or log, and a short
training run shows more of Ray's bookkeeping than of its own progress. Each source is quieted with
the setting Ray offers for it (`Console.apply` before Ray is imported, `Console.after_init` after
``ray.init``):

- the driver's ``ray`` logger: ``ray.init(logging_level=WARNING)`` (`Console.init_options`);
- a local Ray's notice that it turned token authentication on: ``RAY_AUTH_MODE=token``, the mode Ray
  picks anyway for a local cluster, set explicitly (Ray says nothing about a mode it was given);
- Ray Data's progress bars and, off a terminal, its ``logging_progress`` blocks: the driver's
  ``DataContext.enable_progress_bars = False`` and its ``ray.data`` logger at WARNING (the embedding
  job prints its own progress; training ranks turn theirs off per dataset and log their own);
- Ray Train's INFO lines: its ``RunConfig(logging_config=LoggingConfig(log_level=...))``
  (`train_log_level`);
- lines that Ray's processes print at a level no setting reaches (`QUIET_LINES`): Ray's driver-side
  filter of forwarded lines, ``RAY_DEDUP_LOGS_SKIP_REGEX`` (read when Ray is imported), and ahead of
  it `QuietRecords`, which drops such a line with the traceback its log record carries; the same
  patterns filter the driver's own Ray loggers;
- the core worker's actor-restart notice, written once per process to the driver's stderr when Ray Data
  starts an actor pool: spent on an actor that never runs (`spend_actor_restart_notice`);
- colour where stdout is no terminal (a log file, ``ray job logs``): ``RAY_COLOR_PREFIX=0`` for the
  ``(Actor pid=...)`` prefixes; the escape codes Ray writes regardless (its green
  ``[repeated Nx across cluster]`` note) are stripped from the driver's stdout and stderr.

``--verbose`` applies none of it: the console Ray gives by default. Settings the user exported
already win over these (``os.environ.setdefault``).

Nothing here imports Ray at import time (nor does `pipeline.compat`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any, TextIO

from pipeline import compat

# Lines that no log level or Ray setting reaches, each with where it comes from. Matched anywhere in
# a line (Python `re.search`), so a pattern must be specific to its message.
QUIET_LINES: dict[str, str] = {
    # Every Ray Train worker, at every ray.train.report: logged at INFO through the root logger (its
    # logger is named by a file path, outside ``ray.train``), which Ray Train sets to INFO in each
    # worker, so RunConfig's LoggingConfig does not reach it. vitray prints its own line per report.
    "ray_train_report": r"Reporting training result \d+: TrainingReport\(",
    # Ray Train's PlacementGroupCleaner, every second while Ray's state API does not answer it: the
    # retry of a safety net for a controller that died, with nothing for the user to do.
    "placement_group_cleaner": r"Failed to query Ray Train Controller actor state",
    # core_worker.cc, once per worker group: how Ray Train itself creates its PreemptionWatcher actor.
    "preemption_watcher": r"'PreemptionWatcher' and ID: '\w+' has constructor arguments in the object store",
    # Ray Data, once per process where vitray turned the bars off on purpose (it reports progress itself).
    "ray_data_bars_off": r"Progress bars disabled\. To enable",
    # Ray Train's controller, with a traceback, when Ray's autoscaling coordinator does not answer its
    # resource request (sent every 20 s) within 5 s: on a busy machine. The run goes on; nothing to do.
    "resource_request": r"Failed to (?:send|cancel) resource request for train-\w+",
    # The raylet, when more worker processes start at once than twice a node's CPUs: a training run's
    # checkpoint probe holds tasks and an actor of no CPU (`pipeline.train.scoring.probe`), a process each.
    "worker_startup": r"PYTHON worker processes have been started on node",
}

# Set while a job runs (`Console.apply`), for the library code that configures Ray per run
# (`train_log_level`); a job that never called `apply` gets Ray's quiet defaults of vitray.
_active: Console | None = None


def quiet_pattern() -> str:
    """`QUIET_LINES` as one regular expression."""
    return "|".join(f"(?:{p})" for p in QUIET_LINES.values())


class QuietFilter(logging.Filter):
    """Drops log records whose message matches `QUIET_LINES` (for the driver's own Ray loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.pattern = re.compile(quiet_pattern())

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@dataclass(frozen=True)
class Console:
    """The console settings of one job: quiet by default, Ray's own with ``verbose``."""

    verbose: bool = False
    colour: bool = True  # False where stdout is no terminal

    @classmethod
    def for_stream(cls, verbose: bool, stream: TextIO | None = None) -> Console:
        stream = stream if stream is not None else sys.stdout
        return cls(verbose=verbose, colour=_is_terminal(stream))

    def environment(self, *, local: bool) -> dict[str, str]:
        """The environment variables to set before Ray is imported (and a local Ray started)."""
        env: dict[str, str] = {}
        if not self.colour:
            env["RAY_COLOR_PREFIX"] = "0"
        if self.verbose:
            return env
        env["RAY_DEDUP_LOGS_SKIP_REGEX"] = quiet_pattern()
        if local:
            env["RAY_AUTH_MODE"] = "token"
        return env

    def apply(self, *, local: bool) -> None:
        """Call before ``import ray``: Ray reads the skip pattern and the auth mode when imported."""
        global _active
        for name, value in self.environment(local=local).items():
            os.environ.setdefault(name, value)
        if not self.colour:
            _strip_colour()
        _active = self

    def init_options(self) -> dict[str, Any]:
        """Keyword arguments for ``ray.init``."""
        return {"logging_level": logging.INFO if self.verbose else logging.WARNING}

    def after_init(self) -> None:
        """Call after ``ray.init``: the driver's Ray Data settings and the filter on its Ray loggers."""
        follow_stderr()
        compat.filter_forwarded_logs("vitray_stopped", _drop_once_stopped)
        _note_sigterm()
        if self.verbose:
            return
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        for name in ("ray", "ray.data"):
            for handler in logging.getLogger(name).handlers:
                if not any(isinstance(f, QuietFilter) for f in handler.filters):
                    handler.addFilter(QuietFilter())
        compat.filter_forwarded_logs("vitray_quiet_records", QuietRecords())
        spend_actor_restart_notice()


# Set once a job has written its last line (`stop_worker_lines`); cleared when a job starts.
_stopped = threading.Event()


_signalled: list[int] = []  # the SIGTERM that stopped this job, where one did (`signalled`)


def _note_sigterm() -> None:
    """After ``ray.init``: a SIGTERM ends the job as Ray's handler does (``SystemExit(15)``), noted, since
    a ``ray.get`` it interrupts turns it into ``SystemExit(1)`` (Ray's ``check_status``), and the job's
    line then named no signal (`pipeline.cli.run_job`)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum: int, _frame: Any) -> None:
        _signalled.append(signum)
        raise SystemExit(signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def signalled() -> int | None:
    """The signal that stopped this job since it started (`resume_worker_lines`), or None."""
    return _signalled[-1] if _signalled else None


def stop_worker_lines() -> None:
    """From now on the lines Ray's processes print reach no console: a job stopped by a signal says so
    in its last line, and its workers, stopping too, would otherwise go on printing after it."""
    _stopped.set()


def resume_worker_lines() -> None:
    """A job starts: the lines of Ray's processes reach the console again (`stop_worker_lines`), and no
    signal has stopped it."""
    _stopped.clear()
    _signalled.clear()


def _drop_once_stopped(batch: dict[str, Any]) -> None:
    if _stopped.is_set():
        batch["lines"] = []


class CurrentStderr(logging.StreamHandler):
    """A log handler that writes to ``sys.stderr`` as it is when a record is emitted, not as it was when
    the handler was made: a stream since replaced (`StripColour`, a test's capture) may be closed."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _stream: TextIO) -> None:
        pass  # set by StreamHandler.__init__ and setStream; this handler reads sys.stderr at each record


def follow_stderr() -> None:
    """Ray's console handlers on its loggers (``ray``, ``ray.data``, ``ray.train``) become `CurrentStderr`
    handlers, with their level, format and filters. Ray makes them when ``ray`` (or ``ray.data``) is first
    imported, bound to the ``sys.stderr`` of that moment; where that stream was replaced and closed since
    (the capture of the test that first imported Ray Data), each of their records would end in a "Logging
    error" on the stderr of the moment instead. Called at each job's start (`pipeline.cli.run_job`) and
    after ``ray.init`` (`Console.after_init`); a handler already following is left alone."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or not (name == "ray" or name.startswith("ray.")):
            continue
        for i, handler in enumerate(logger.handlers):
            if compat.is_ray_console_handler(handler):
                following = CurrentStderr()
                following.setLevel(handler.level)
                following.setFormatter(handler.formatter)
                following.name, following.filters = handler.name, list(handler.filters)
                logger.handlers[i] = following
                handler.close()


# The lines after a log record's message when it carries an exception (``exc_info``).
TRACEBACK_START = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class QuietRecords:
    """Drops the `QUIET_LINES` among the lines Ray forwards to the driver, each with the traceback that
    follows it (indented frames up to the exception's line, chained ones too); every other line,
    a traceback after any other message included, is kept. Called per batch of one process's lines
    (`compat.filter_forwarded_logs`); a record split over two batches is followed across them."""

    def __init__(self) -> None:
        self.pattern = re.compile(quiet_pattern())
        # (ip, pid, stream) -> where that process's dropped record is: "message" (a traceback may
        # follow), "frames" (inside one), "raised" (after its exception's line: a chained one may follow)
        self.open: dict[tuple, str] = {}

    def __call__(self, batch: dict[str, Any]) -> None:
        source = (batch.get("ip"), batch.get("pid"), batch.get("is_err"))
        batch["lines"] = [line for line in batch.get("lines", []) if not self.drops(source, line)]

    def drops(self, source: tuple, line: str) -> bool:
        state = self.open.pop(source, None)
        if self.pattern.search(line):
            self.open[source] = "message"
            return True
        if state is None:
            return False
        if not line.strip() or (state == "frames" and line[:1].isspace()):
            self.open[source] = state
        elif line.startswith(TRACEBACK_START) and state in ("message", "raised"):
            self.open[source] = "frames"
        elif state == "frames":
            self.open[source] = "raised"  # the exception's line ends the frames
        elif line.startswith(CHAINED) and state == "raised":
            self.open[source] = "message"
        else:
            return False  # the record ended: a line of its own
        return True


# Ray's core worker writes this ERROR line (ray#53727) straight to the driver's stderr, once per process,
# when the driver creates an actor that may restart and takes an argument by reference. Ray Data
# creates every actor-pool worker so (its function travels by reference, restarts are on) and holds
# that reference for the operator's life, so the restart it warns of cannot fail; no setting quiets it.
ACTOR_RESTART_NOTICE = r"has constructor arguments in the object store and max_restarts > 0"


def spend_actor_restart_notice() -> None:
    """Spend the driver's one `ACTOR_RESTART_NOTICE` on an actor that is never scheduled (it asks for a
    resource no node has) and is killed at once, with fd 2 captured meanwhile: what else was written
    there in that moment goes back to stderr. The embedding job's actor pool then starts quietly."""
    import tempfile

    import ray

    @ray.remote(num_cpus=0, max_restarts=1, resources={"vitray-never-scheduled": 1})
    class Unscheduled:
        def __init__(self, _argument: Any):
            pass

    argument = ray.put(None)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            actor = Unscheduled.remote(argument)  # the core worker logs while creating it, in this call
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        ray.kill(actor)
        captured.seek(0)
        for line in captured.read().decode(errors="replace").splitlines(keepends=True):
            if not re.search(ACTOR_RESTART_NOTICE, line):
                sys.stderr.write(line)


def train_log_level() -> str:
    """The level of Ray Train's own console lines for this job (its RunConfig's LoggingConfig)."""
    return "INFO" if _active is not None and _active.verbose else "WARNING"


def local_api_server_options() -> dict[str, Any]:
    """``ray.init`` options that pin a local Ray's API server to a free port, which its processes are
    told through ``RAY_API_SERVER_ADDRESS``.

    Ray Train's PlacementGroupCleaner (a detached actor) asks Ray's state API whether the run's
    controller is alive; given no address, it looks for "the" Ray on the machine, and where several
    local Rays run (tests, two jobs) it stops with a traceback instead. Set before ``ray.init``, the
    variable reaches every process of the local Ray.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{port}"
    return {"dashboard_host": "127.0.0.1", "dashboard_port": port}


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class StripColour:
    """A text stream that writes what it is given without ANSI escape codes."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(ANSI_ESCAPE.sub("", text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _strip_colour() -> None:
    """This process's stdout and stderr (no terminal) drop ANSI escape codes."""
    if not isinstance(sys.stdout, StripColour):
        sys.stdout = StripColour(sys.stdout)
    if not isinstance(sys.stderr, StripColour):
        sys.stderr = StripColour(sys.stderr)
