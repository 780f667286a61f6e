"""The command-line dialect every job shares: config fields as flags, one way to reach Ray, one-line errors.

A job's command line is a config dataclass (a preset, or the dataclass's defaults) plus flags made from
its settings (`pipeline.settings`: one flag per field, its help the field's doc line); a flag left out
keeps the base value. A value no run can use (outside the bounds its setting declares, NaN, infinite, a
word where a number goes) is one ``error: ...`` line and exit code 2, from the parser (`JobParser`) or
from the config's ``validate``; ``--print-config`` prints only a config that validates. Every job joins
Ray the same way (`connect_ray`: ``--address``, else ``RAY_ADDRESS``, else a local Ray with enough logical
CPUs) and ends the same way (`run_job`; a job script's whole ``main`` is `main(parser, command, argv)`): bad input found before any cluster work is one
``error: ...`` line and exit code 2; a run that started and then stopped on an error is one line and
exit code 1. Which of the two an error is depends on when it came: a job calls `start_work` where
its checks end and its work begins (the first write to ``--out``, the first task on the cluster), so
a full disk or a lost store after that is a failed run, not bad input. Whatever ends a job (an
exception with an empty message, one raised inside a Ray task or actor, Ctrl-C, a SIGTERM turned
into ``SystemExit`` by Ray) ends it with one ``error:`` line that gives a reason.

Nothing here imports Ray, torch or a job's own package at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pipeline import settings
from pipeline.redaction import public_text

EXIT_BAD_INPUT = 2  # found before cluster work: nothing ran
EXIT_RUN_FAILED = 1  # the run started, then stopped on an error

# Ray Train's controller polls its workers every 2 s by default, and a run waits on that poll at its
# start, at each report and at its end; on a local Ray a short poll costs nothing that matters
# (BENCHMARKS.md, "Local Ray").
# Ray starts its workers (training workers, decode tasks, model actors) at niceness 15 by default, so
# that its daemons stay responsive: on a machine shared with other work that leaves a job a few percent
# of the CPU that an ordinary process beside it gets (a task that takes 0.1 s alone took 10x as long
# beside two busy shell loops; BENCHMARKS.md, "The host beside a device-shaped step"). A local Ray
# is the user's own job: its workers run at the niceness of the command that started it.
LOCAL_RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25", "RAY_worker_niceness": "0"}


def apply_local_ray_env() -> None:
    """Set `LOCAL_RAY_ENV` where unset; call before a local Ray starts, so its processes inherit it."""
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)


def pair(text: str) -> tuple[float, float]:
    """``"0.08,1"`` -> ``(0.08, 1.0)``: the form of range flags (``--crop-scale MIN,MAX``)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (two numbers and a comma)")
    try:
        return float(parts[0]), float(parts[1])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (two numbers and a comma)") from e


def words(text: str) -> tuple[str, ...]:
    """``"jpg,png"`` -> ``("jpg", "png")``: the form of list flags."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


class _GivenAsNone:
    """What a flag of an optional field returns for ``none``: `overrides` turns it into None; a plain
    None is a flag left out, which keeps the base value."""

    def __repr__(self) -> str:
        return "none"


GIVEN_AS_NONE = _GivenAsNone()


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``none`` (any case) -> None in the config, for fields where None means "not there"
    (``--label-key none``); anything else through ``parse``."""

    def parse_or_none(text: str) -> Any:
        return GIVEN_AS_NONE if text.lower() == "none" else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")
    return parse_or_none


def json_object(text: str) -> dict:
    """A JSON object given on the command line (``--storage-options '{...}'``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, {...}")
    return value


def _parser_for(annotation: Any) -> tuple[Callable[[str], Any] | None, bool]:
    """(text parser, optional) for a field's type; parser None for bool (a switch)."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(inner) < len(typing.get_args(annotation))
        annotation = inner[0] if len(inner) == 1 else str
    origin = typing.get_origin(annotation) or annotation
    if annotation is bool:
        return None, optional
    if origin is tuple:
        args = typing.get_args(annotation)
        return (words if args and args[0] is str else pair), optional
    if origin is dict:
        return json_object, optional
    if annotation in (int, float, str):
        return annotation, optional
    raise TypeError(f"no command-line form for a field of type {annotation!r}; give the setting parse=")


def add_settings(
    parser: argparse.ArgumentParser,
    config_type: type,
    *,
    defaults: Any = None,
    exclude: Sequence[str] = (),
    required: Sequence[str] = (),
) -> None:
    """One flag per setting of ``config_type`` (`pipeline.settings`), its help the field's doc line.

    ``defaults`` (a config) shows each flag's default in its help, after the bounds its setting declares;
    ``exclude`` names fields or whole sections that are no flags of this job; ``required`` names fields the
    job cannot run without. A field without a default is a required flag too (a setting's ``required=``
    refuses an empty value: `pipeline.settings.check`). A bool is a pair of switches, ``--x`` / ``--no-x``.
    """
    for path, f, option in settings.flags(config_type):
        if any(part in exclude for part in path):
            continue
        owner = config_type
        for part in path[:-1]:
            owner = settings.hints(owner)[part]
        parse, optional = _parser_for(settings.hints(owner)[f.name])
        text = settings.help_of(f, config_type)
        if settings.bounds_text(f):
            text += f"; {settings.bounds_text(f)}"
        must = f.name in required or (
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if defaults is not None and not must and "default:" not in text:
            text += f" (default: {settings.shown(settings.get(defaults, path))})"
        dest = f.name
        if parse is None and f.metadata.get("parse") is None:
            parser.add_argument(
                f"--{option}", dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text
            )
            if f.metadata.get("negative"):
                parser.add_argument(
                    f"--{f.metadata['negative']}",
                    dest=dest,
                    action="store_const",
                    const=False,
                    help=f"same as --no-{option}",
                )
            continue
        parse = f.metadata.get("parse") or parse
        parser.add_argument(
            f"--{option}",
            dest=dest,
            type=_or_none(parse) if optional else parse,
            default=None,
            choices=f.metadata.get("choices"),
            required=must,
            metavar=f.metadata.get("metavar")
            or ("|".join(f.metadata["choices"]) if f.metadata.get("choices") else None),
            help=text,
        )


def overrides(args: argparse.Namespace, config_type: type) -> dict[str, Any]:
    """The settings the command line gave, by field name (flags left out are absent, so the base
    value stays; a flag given as ``none`` sets None)."""
    given = {}
    for _, f, _ in settings.flags(config_type):
        value = getattr(args, f.name, None)
        if value is not None:
            given[f.name] = None if value is GIVEN_AS_NONE else value
    return given


class JobParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line, as every other refusal of a job is (argparse
    would print the whole usage first: some 70 lines for a training job)."""

    def __init__(self, **kwargs: Any):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_BAD_INPUT, public_text(f"error: {message}; {self.prog} --help lists the options\n"))


def job_parser(
    prog: str,
    description: str | None,
    config_type: type,
    *,
    defaults: Any = None,
    ray: bool = True,
    **options: Any,
) -> argparse.ArgumentParser:
    """The command line of a job: a flag per setting of ``config_type`` (`add_settings` takes
    ``options``), then Ray's flags, or with ``ray=False`` only ``--print-config``."""
    parser = JobParser(prog=prog, description=description)
    add_settings(parser, config_type, defaults=defaults, **options)
    if ray:
        add_ray_flags(parser)
    else:
        parser.add_argument(
            "--print-config", action="store_true", help="print the resolved configuration as JSON and exit"
        )
    return parser


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument(
        "--num-cpus",
        type=bounded_int(1, MAX_LOCAL_CPUS),
        help="logical CPUs of a local Ray (default: this machine's, or what the job needs if more); "
        f"from 1 to {MAX_LOCAL_CPUS:,}",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration as JSON and exit"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's own console output too (its INFO logs, progress bars, every forwarded line)",
    )


MAX_LOCAL_CPUS = 65_536  # logical CPUs a local Ray may declare: far above any one machine's


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """The parser of a whole-number flag that is no setting (``--num-cpus``): ``low`` to ``high``."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from e
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low:,} to {high:,}, got {value:,}")
        return value

    return whole_number


def ray_address(args: argparse.Namespace) -> str | None:
    """The cluster a job joins: ``--address``, else ``RAY_ADDRESS``; None means a local Ray."""
    return args.address or os.environ.get("RAY_ADDRESS") or None


def connect_ray(args: argparse.Namespace, *, needed_cpus: float) -> bool:
    """Join ``--address`` (else ``RAY_ADDRESS``), or start a local Ray with at least ``needed_cpus``
    logical CPUs: training workers and model actors must leave slots for the decode tasks, which
    would otherwise wait forever on a small machine. Returns True when it started a local Ray."""
    from pipeline.console import Console, local_api_server_options

    address = ray_address(args)
    console = Console.for_stream(verbose=getattr(args, "verbose", False))
    console.apply(local=not address)  # before `import ray`: Ray reads some settings at import
    import ray

    if address:
        ray.init(address=address, **console.init_options())
        console.after_init()
        return False
    needed = math.ceil(needed_cpus)
    if args.num_cpus is not None and args.num_cpus < needed:
        raise ValueError(
            f"--num-cpus {args.num_cpus} is fewer than the {needed} logical CPUs this job needs (its "
            "workers plus room to decode images); pass a larger --num-cpus or use fewer workers"
        )
    apply_local_ray_env()
    ray.init(
        address="local",
        num_cpus=args.num_cpus or max(os.cpu_count() or 1, needed),
        include_dashboard=False,
        **local_api_server_options(),
        **console.init_options(),
    )
    console.after_init()
    return True


# How long a job on a joined cluster waits for a node with its --decode-nodes label: a cloud node starts
# in minutes. Seconds between looks at the cluster's nodes while it waits.
DECODE_NODES_WAIT_S = 600.0
DECODE_NODES_POLL_S = 5.0


def check_decode_nodes(label: str | None, *, local: bool, wait_s: float | None = None) -> None:
    """With ``--decode-nodes KEY=VALUE``, a node of the connected Ray that carries the label, or a one-line
    ValueError: at once on a local Ray the job started (no node can join it), after a bounded wait
    (``wait_s``, default `DECODE_NODES_WAIT_S`) on a joined cluster, whose autoscaler is asked meanwhile
    for one CPU on such a node (`ray.autoscaler.sdk.request_resources`; the request is withdrawn after).
    Without it the read tasks would wait for such a node for ever. Call after `connect_ray`."""
    if label is None:
        return
    import ray

    key, value = label.split("=", 1)

    def labelled() -> bool:
        return any(n.get("Alive") and (n.get("Labels") or {}).get(key) == value for n in ray.nodes())

    if labelled():
        return
    if local:
        raise ValueError(
            f"--decode-nodes {label}: no node of the local Ray this job started carries that label, and no "
            "node can join it; drop --decode-nodes, or pass --address (or RAY_ADDRESS) of a cluster whose "
            "decode nodes carry it"
        )
    wait_s = DECODE_NODES_WAIT_S if wait_s is None else wait_s
    print(f"waiting up to {wait_s:g} s for a node labelled {label} (--decode-nodes) to join", flush=True)
    _request_decode_node({key: value})
    start = time.monotonic()
    try:
        while time.monotonic() - start < wait_s:
            time.sleep(min(DECODE_NODES_POLL_S, max(wait_s - (time.monotonic() - start), 0.0)))
            if labelled():
                return
    finally:
        _request_decode_node(None)
    raise ValueError(
        f"--decode-nodes {label}: no node of the cluster carried that label after waiting "
        f"{round(time.monotonic() - start, 1):g} s; start nodes with it (a decode node type with min_workers, "
        "docs/scaling.md, 'Where decode runs'), or drop --decode-nodes"
    )


def _request_decode_node(selector: dict[str, str] | None) -> None:
    """Ask the cluster's autoscaler for one CPU on a node matching ``selector`` (None: withdraw it). A hint
    only: a cluster without an autoscaler, or one that cannot take it, is waited on as it is."""
    from ray.autoscaler import sdk

    request = {"bundles": [{"CPU": 1}], "bundle_label_selectors": [selector]} if selector else {"bundles": []}
    with contextlib.suppress(Exception):  # a hint that fails changes nothing the wait does not say
        sdk.request_resources(**request)


def print_config(config: Any) -> None:
    print(json.dumps(settings.to_dict(config), indent=2, sort_keys=True))


def configured(args: argparse.Namespace, config_type: type, **fields: Any) -> Any | None:
    """The ``config_type`` the command line gives (its flags, and ``fields``); None once it is printed
    under ``--print-config`` (the job then ends with exit code 0)."""
    config = config_type(**overrides(args, config_type), **fields)
    return None if printed(args, config) else config


def printed(args: argparse.Namespace, config: Any) -> bool:
    """Under ``--print-config``: print ``config`` and say so (the job then ends with exit code 0), once
    it validates (its ``validate``, else the bounds of its settings): a config no run could use is its
    one-line ValueError, not printed."""
    if not getattr(args, "print_config", False):
        return False
    validate = getattr(config, "validate", None)
    if callable(validate):
        validate()
    else:
        settings.check(config)
    print_config(config)
    return True


EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it

# Set by `start_work`, reset by `run_job`: whether an error now is a failed run rather than bad input.
_work_started = False


class RunFailed(RuntimeError):
    """A run that ended without an exception but did not do all it should (its line says what)."""


def start_work() -> None:
    """Mark the end of a job's checks: from here on an error is a failed run (exit 1), not bad input."""
    global _work_started
    _work_started = True


# Errors of the object-store clients that fsspec passes through unchanged (an endpoint that refuses
# connections, missing credentials, a denied request): matched by the module of their class, so that
# no client library is imported here.
STORAGE_ERROR_MODULES = ("botocore.", "aiobotocore.", "google.auth.", "google.api_core.", "azure.core.")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def is_storage_error(error: BaseException) -> bool:
    return any(cls.__module__.startswith(STORAGE_ERROR_MODULES) for cls in type(error).__mro__)


def _remote_origin(error: BaseException) -> BaseException | str:
    """The error a Ray wrapper carries: a Ray Train worker's, a task's cause, or, where the cause did not
    survive the trip (Ray Data's ``UserCodeException`` drops it), the first exception line of the remote
    traceback text."""
    failures = getattr(error, "worker_failures", None)
    if isinstance(failures, dict) and failures:
        return _remote_origin(failures[min(failures)])
    controller = getattr(error, "controller_failure", None)
    if isinstance(controller, BaseException):
        return _remote_origin(controller)
    cause = getattr(error, "cause", None)
    if type(error).__module__.startswith("ray.") and isinstance(cause, BaseException):
        if type(cause).__name__ != "UserCodeException":
            return _remote_origin(cause)
        skip = ("Traceback", "The above exception", "During handling")
        for line in _ANSI.sub("", str(error)).splitlines():
            if line.strip() and not line[0].isspace() and "(pid=" not in line and not line.startswith(skip):
                return line.strip()
    return error


def reason(error: BaseException, *, worded: tuple[type[BaseException], ...] = ()) -> str:
    """One line that says why ``error`` ended a job: its message's first line, led by its type's name
    where the type is not one whose messages are written for users (or the message is empty)."""
    origin = _remote_origin(error)
    if isinstance(origin, str):
        return origin
    lines = [line.strip() for line in _ANSI.sub("", str(origin)).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " ..."
    if text and isinstance(origin, (ValueError, OSError, RunFailed, *worded)) and origin is error:
        return text
    name = type(origin).__name__
    return f"{name}: {text}" if text else f"{name} (no message)"


def _say(line: str) -> None:
    """An error line on stderr, its URLs without userinfo or query string (a password, a SAS token)."""
    with contextlib.suppress(OSError, ValueError):  # stderr closed or gone: the exit code still tells
        print(public_text(line), file=sys.stderr, flush=True)


def _keep_traceback(error: BaseException) -> str:
    """Write the traceback of an unforeseen error to a file; returns the note that names it."""
    try:
        fd, path = tempfile.mkstemp(prefix="vitray-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(public_text("".join(traceback.format_exception(error))))
    except OSError:
        return ""
    return f" (traceback: {path})"


Failures = tuple[type[BaseException], ...] | Callable[[], tuple[type[BaseException], ...]]


def main(
    parser: argparse.ArgumentParser,
    command: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
    *,
    failures: Failures = (),
) -> int:
    """The whole of a job script's ``main``: ``argv`` (else ``sys.argv``) through ``parser``, then
    ``command(args)`` under `run_job`, which turns whatever ends it into an exit code and one line.
    A usage error is one line (`JobParser`), exit code 2."""
    args = parser.parse_args(argv)
    return run_job(lambda: command(args), failures=failures)


def run_job(body: Callable[[], int], *, failures: Failures = ()) -> int:
    """Run a job's body and end it with an exit code and, on any error, one ``error: ...`` line on stderr.

    Before `start_work`: ``ValueError``, ``OSError`` and the object stores' client errors (raised by the
    checks) -> `EXIT_BAD_INPUT`. One of ``failures`` (the run's own errors), `RunFailed`, or any error
    after `start_work` -> `EXIT_RUN_FAILED`; so is an unforeseen error at any time, whose traceback is
    written to a file the line names. Ctrl-C -> `EXIT_INTERRUPTED`; a ``SystemExit`` keeps its code. A body
    returns 0; a body that returns another code gets a line saying so. ``failures`` may be a function
    that returns the classes: it is called only when an error comes, so that a job's own modules (Ray
    Train's driver, the embedding job) load with its work, not with ``--help``.
    """
    global _work_started
    _work_started = False
    from pipeline.console import follow_stderr, resume_worker_lines, signalled, stop_worker_lines

    follow_stderr()  # Ray's console handlers, made when Ray was imported, may hold a stream closed since
    resume_worker_lines()
    try:
        code = body()
    except KeyboardInterrupt:
        stop_worker_lines()  # the workers stop too: none of their lines after this one
        _say("error: interrupted (Ctrl-C); run the same command again to continue")
        return EXIT_INTERRUPTED
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return 0
        if not isinstance(e.code, int):
            _say(f"error: {e.code}")
            return EXIT_RUN_FAILED
        code = signalled() or e.code  # a SIGTERM that a ray.get turned into SystemExit(1) keeps its code
        if code == 15:
            stop_worker_lines()
            _say("error: stopped by a SIGTERM (exit code 15); run the same command again to continue")
        else:
            _say(f"error: stopped by SystemExit({code})")
        return code
    except Exception as e:
        own = failures() if callable(failures) else failures
        if isinstance(e, (*own, RunFailed)):
            _say(f"error: {reason(e, worded=own)}")
            return EXIT_RUN_FAILED
        foreseen = isinstance(e, (ValueError, OSError)) or is_storage_error(e)
        note = "" if foreseen else _keep_traceback(e)
        if is_storage_error(e):
            note += "; check the store's endpoint and credentials (AWS_* variables, --storage-options)"
        _say(f"error: {reason(e)}{note}")
        return EXIT_BAD_INPUT if foreseen and not _work_started else EXIT_RUN_FAILED
    if code:
        _say(f"error: the job ended with exit code {code}")
    return code
