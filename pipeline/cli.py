"""The command-line dialect every job shares: config fields as flags, one way to reach Ray, one-line errors.

A job's command line is a config dataclass (a preset, or the dataclass's defaults) plus a few flags,
each `Flag` naming the field it sets; a flag left out keeps the base value. Every job joins Ray the
same way (`connect_ray`: ``--address``, else ``RAY_ADDRESS``, else a local Ray with enough logical
CPUs) and ends the same way (`run_job`): bad input found before any cluster work is one
``error: ...`` line and exit code 2; a run that started and then stopped on an error is one line and
exit code 1.

Nothing here imports Ray, torch or a job's own package at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

EXIT_BAD_INPUT = 2  # found before cluster work: nothing ran
EXIT_RUN_FAILED = 1  # the run started, then stopped on an error

# Ray Train's controller polls its workers every 2 s by default, and a run waits on that poll at its
# start, at each report and at its end; on a local Ray a short poll costs nothing that matters
# (BENCHMARKS.md, "Local Ray").
LOCAL_RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25"}


def apply_local_ray_env() -> None:
    """Set `LOCAL_RAY_ENV` where unset; call before a local Ray starts, so its processes inherit it."""
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class Flag:
    """One flag that sets one config field; its parser follows the field's type unless given.

    A bool field is a switch: ``--field`` sets it True, or, with ``negate``, ``--no-field`` sets it False
    (for a field that is on by default, such as ``hflip``).
    """

    field: str
    help: str
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    required: bool = False
    metavar: str | None = None
    negate: bool = False

    @property
    def option(self) -> str:
        return ("--no-" if self.negate else "--") + self.field.replace("_", "-")


def pair(text: str) -> tuple[float, float]:
    """``"0.08,1"`` -> ``(0.08, 1.0)``: the form of range flags (``--crop-scale MIN,MAX``)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (two numbers and a comma)")
    try:
        return float(parts[0]), float(parts[1])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (two numbers and a comma)") from e


class _GivenAsNone:
    """What `optional_str` returns for ``none``: a flag given as none, which `overrides` turns into
    None; a plain None is a flag left out, which keeps the base value."""

    def __repr__(self) -> str:
        return "none"


GIVEN_AS_NONE = _GivenAsNone()


def optional_str(text: str) -> str | _GivenAsNone:
    """``none`` (any case) -> None in the config, for fields where None means "not there"
    (``--label-key none``)."""
    return GIVEN_AS_NONE if text.lower() == "none" else text


def json_object(text: str) -> dict:
    """A JSON object given on the command line (``--storage-options '{...}'``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, {...}")
    return value


def _parser_for(annotation: Any) -> Callable[[str], Any] | None:
    """The text parser for a field's type; None for bool (a switch)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = inner[0] if len(inner) == 1 else str
    origin = typing.get_origin(annotation) or annotation
    if annotation is bool:
        return None
    if origin is tuple:
        return pair
    if origin is dict:
        return json_object
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"no command-line form for a field of type {annotation!r}; give the Flag a type")


def add_flags(
    parser: argparse.ArgumentParser, config_type: type, flags: Sequence[Flag], defaults: Any = None
) -> None:
    """Add one flag per `Flag`; with ``defaults`` (a config), each help text ends with its default."""
    hints = typing.get_type_hints(config_type)
    names = {f.name for f in dataclasses.fields(config_type)}
    for flag in flags:
        if flag.field not in names:
            raise TypeError(f"{config_type.__name__} has no field {flag.field!r} for {flag.option}")
        text = flag.help
        if defaults is not None and not flag.required and "default" not in text:
            text += f" (default: {getattr(defaults, flag.field)})"
        kind = flag.type or _parser_for(hints[flag.field])
        if kind is None:
            action = "store_false" if flag.negate else "store_true"
            parser.add_argument(flag.option, dest=flag.field, action=action, default=None, help=text)
            continue
        parser.add_argument(
            flag.option,
            dest=flag.field,
            type=kind,
            default=None,
            choices=flag.choices,
            required=flag.required,
            metavar=flag.metavar,
            help=text,
        )


def overrides(args: argparse.Namespace, flags: Sequence[Flag]) -> dict[str, Any]:
    """The fields the command line set (flags left out are absent, so the base value stays; a flag
    given as ``none`` sets None)."""
    given = {f.field: getattr(args, f.field) for f in flags if getattr(args, f.field) is not None}
    return {name: None if value is GIVEN_AS_NONE else value for name, value in given.items()}


def add_ray_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument(
        "--num-cpus",
        type=int,
        help="logical CPUs of a local Ray (default: this machine's, or what the job needs if more)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration as JSON and exit"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray's own console output too (its INFO logs, progress bars, every forwarded line)",
    )


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


def print_config(config: Any) -> None:
    values = config.to_dict() if hasattr(config, "to_dict") else dataclasses.asdict(config)
    print(json.dumps(values, indent=2, sort_keys=True))


def run_job(body: Callable[[], int], *, failures: tuple[type[BaseException], ...] = ()) -> int:
    """Run a job's body and turn its errors into one line on stderr and an exit code.

    ``ValueError`` / ``OSError`` (raised by the checks before cluster work) -> `EXIT_BAD_INPUT`;
    one of ``failures`` (the run's own errors, raised after it started) -> `EXIT_RUN_FAILED`.
    """
    try:
        return body()
    except failures as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
