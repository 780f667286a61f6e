"""Config dataclasses as settings: one field, one doc line, one flag, one JSON form.

A job's configuration is a frozen dataclass, or a dataclass of sections that are frozen dataclasses
owned by the modules that read them (`pipeline.train.config.TrainConfig`). Each field is declared with
`setting(default, "doc line")`; everything else derives from that one declaration:

- the command-line flag and its help (`pipeline.cli.add_settings`): ``--field-name``, or the name given
  as ``flag=``; a field declared with ``flag=None`` is no flag (derived from other sections, or kept for
  the program's own use);
- the flag a validation message names (`flag`), so a message and ``--help`` cannot disagree;
- its bounds (``ge=``, ``gt=``, ``le=``, ``lt=``, ``choices=``, ``required=``): shown in the flag's help and
  in docs/options.md (`bounds_text`), and enforced by `check`, which a config's ``validate`` calls first,
  with one line that names the flag, the value and the bound; checks that compare fields stay in
  ``validate``. Every numeric flag declares a lower and an upper bound (tests/test_bounds.py walks them
  all), and NaN and infinities are within none: a setting's "no limit" is a value of its own, in its doc
  line (``0: off``, ``none: ...``);
- replacing fields by their leaf names across sections (`replace`), which presets and the command line
  share: leaf names are unique within a config, checked when it is first walked;
- JSON both ways (`to_dict` / `from_dict`): strict about unknown keys, tuples restored from the
  field's type, and a version number for configs saved by older runs (a class's ``CONFIG_VERSION`` and
  ``migrate(values, version)``). The JSON form is what outputs record, so it holds no credential: a secret
  (``secret=True``: storage options, how a job reaches its data rather than what it made) keeps only the
  names of the options set, each value ``"***"``, and a URL is written as `pipeline.redaction.public_url`
  writes it (no userinfo, no query string). A run that resumes takes both again from its command line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeline.redaction import REDACTED, public_text, redacted

_HELP = "help"
_FLAG = "flag"
_UNSET = object()

# Upper bounds that settings share (every numeric setting declares both of its bounds: NaN, infinities
# and values no run can use are refused in one line that names the flag, before any work).
MAX_COUNT = 2**31 - 1  # a count of steps, samples, rows, tries: what a C int holds (FAISS, Arrow, torch)
# A seed: torch.manual_seed takes 64 bits, and a resumed checkpoint seeds (seed * 1_000_003 + step) * 1_009
# + rank (`pipeline.train.checkpointing.checkpoint`), which 32-bit seeds keep within them.
MAX_SEED = 2**32 - 1


def setting(
    default: Any = _UNSET,
    help: str = "",
    *,
    flag: str | object | None = _UNSET,
    choices: Sequence[str] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    required: bool = False,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    secret: bool = False,
    negative: str | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field with its doc line and command-line form.

    ``flag``: the option's name without dashes (default: the field name with dashes), or None for a
    field that is no flag. ``parse``: the text parser when the type's own does not fit. ``negative``: a
    second switch that sets a bool field False (``--cpu`` for ``use_gpu``). ``secret``: redacted in JSON.
    ``ge`` / ``gt`` / ``le`` / ``lt``: bounds of a number (of each number of a tuple); ``choices``: the
    values a text may take; ``required``: a value must be given (not None, not empty). None, where the
    type allows it, is outside every bound: it means "not set" (`check`).
    """
    if not help:
        raise TypeError("a setting needs its doc line")
    metadata = {
        _HELP: help,
        "choices": tuple(choices) if choices else None,
        "metavar": metavar,
        "parse": parse,
        "secret": secret,
        "negative": negative,
        "bounds": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None},
        "required": required,
    }
    if flag is not _UNSET:
        metadata[_FLAG] = flag
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    if default is _UNSET:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def leaves(cls: type) -> tuple[tuple[tuple[str, ...], dataclasses.Field], ...]:
    """Every non-section field of ``cls`` and its sections, as (path, field), sections first-to-last."""
    found: list[tuple[tuple[str, ...], dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        kind = hints(cls)[f.name]
        if is_section(kind):
            found += [((f.name, *path), leaf) for path, leaf in leaves(kind)]
        else:
            found.append(((f.name,), f))
    return tuple(found)


@functools.cache
def paths(cls: type) -> dict[str, tuple[str, ...]]:
    """Leaf name -> path of the field that name sets. Where two sections have a field of one name, the
    one that is a flag owns it (the other is derived from it: ``TrainConfig`` sets the data section's
    ``seed`` from ``run.seed``); two flags of one name are a TypeError."""
    owner: dict[str, tuple[str, ...]] = {}
    for path, f in leaves(cls):
        name = path[-1]
        if name not in owner:
            owner[name] = path
            continue
        earlier = dict(leaves(cls))[owner[name]]
        if flag_name(f) and flag_name(earlier):
            raise TypeError(f"{cls.__name__}: two flags set a field named {name!r}")
        if flag_name(f):
            owner[name] = path
    options = [flag_name(f) for _, f in leaves(cls) if flag_name(f)]
    repeated = sorted({o for o in options if options.count(o) > 1})
    if repeated:
        raise TypeError(f"{cls.__name__}: option(s) {repeated} made by two fields")
    return owner


def flag_name(field: dataclasses.Field) -> str | None:
    """The option of a field, without dashes (None: the field is no flag)."""
    name = field.metadata.get(_FLAG, field.name)
    return None if name is None else str(name).replace("_", "-")


def flag(cls: type, name: str) -> str:
    """``--option`` of the field ``name`` of ``cls`` (a leaf name of any section): for messages."""
    path = paths(cls).get(name)
    if path is None:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    option = flag_name(dict(leaves(cls))[path])
    return f"--{option}" if option else name


def shown(value: Any) -> str:
    """A value as its flag is written (``0.08,1`` for a pair, ``none`` for None): for help and messages."""
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return "none" if value is None else str(value)


def help_of(field: dataclasses.Field, cls: type | None = None) -> str:
    """A field's doc line; a config that takes a shared section (`pipeline.storage.Output`) may word it for
    its own job in its ``HELP`` mapping (field name -> doc line)."""
    worded = getattr(cls, "HELP", {}) if cls is not None else {}
    return worded.get(field.name) or field.metadata.get(_HELP, "")


def bounds_text(field: dataclasses.Field) -> str:
    """A field's bounds in words (``at least 1``, ``in (0, 1]``), "" for none: for help and messages."""
    b = field.metadata.get("bounds") or {}
    low = ("[", b["ge"]) if "ge" in b else ("(", b["gt"]) if "gt" in b else None
    high = ("]", b["le"]) if "le" in b else (")", b["lt"]) if "lt" in b else None
    kind = str(field.type).split(" |")[0]
    whole = kind in ("int", "<class 'int'>") or kind.startswith("tuple[int")  # int, int | None, ints
    if low and high and (low[0], high[0]) == ("[", "]") and whole:  # no comma inside the brackets
        return f"from {_number(low[1])} to {_number(high[1])}"
    if low and (high is None or high == (")", math.inf)) and not whole:  # NaN and inf are never within
        return f"a finite number {'at least' if low[0] == '[' else 'more than'} {_number(low[1])}"
    if low and high:
        return f"in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}"
    if low:
        return f"{'at least' if low[0] == '[' else 'more than'} {_number(low[1])}"
    if high:
        return f"{'at most' if high[0] == ']' else 'less than'} {_number(high[1])}"
    return ""


def _number(value: float) -> str:
    """A bound or a value in a message: ``2,147,483,647``, ``0.5``, ``1e-05``."""
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


_COMPARE = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}


def _within(value: float, bounds: dict[str, float]) -> bool:
    """Whether a number is within ``bounds``: NaN and infinities never are (a setting's meaning of "no
    limit" is a value of its own, such as 0 or none, and its doc line says so)."""
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return all(_COMPARE[name](value, bound) for name, bound in bounds.items())


def check(config: Any) -> None:
    """A one-line ValueError for the first field of ``config`` (sections included) outside what its
    setting declares: required and not given, not one of its choices, or outside its bounds. The line
    names the flag (a field that is no flag: the config's class and the field), the value and the bound."""
    cls = type(config)
    for path, f in leaves(cls):
        value = get(config, path)
        option = flag_name(f)
        name = f"--{option}" if option else f"{cls.__name__}: {f.name}"
        if f.metadata.get("required") and value in (None, "", ()):
            raise ValueError(f"{name} is required: {help_of(f, cls)}")
        if value is None or isinstance(value, bool):
            continue
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        bounds = f.metadata.get("bounds")
        values = value if isinstance(value, tuple) else (value,)
        if bounds and not all(isinstance(v, int | float) and _within(v, bounds) for v in values):
            each = "each " if isinstance(value, tuple) else ""
            got = (
                shown(value)
                if isinstance(value, tuple)
                else f"{value:,}"
                if isinstance(value, int)
                else value
            )
            raise ValueError(f"{name} must {each}be {bounds_text(f)}, got {got}")


def flags(cls: type) -> Iterator[tuple[tuple[str, ...], dataclasses.Field, str]]:
    """(path, field, option) for every field of ``cls`` that is a flag."""
    for path, f in leaves(cls):
        option = flag_name(f)
        if option:
            yield path, f, option


def get(config: Any, path: Sequence[str]) -> Any:
    for part in path:
        config = getattr(config, part)
    return config


def replace(config: Any, **changes: Any) -> Any:
    """``config`` with fields replaced by name, whatever section holds them: a field's own name, or its
    flag's (``crop_scale`` for ``--crop-scale``, ``data`` for ``--data``); a section may also be replaced
    whole by its own name and a section object. Unknown names are a one-line ValueError."""
    cls = type(config)
    owners = paths(cls)
    direct = {f.name for f in dataclasses.fields(cls)}
    by_section: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    aliases = {flag_name(f).replace("-", "_"): path for path, f in leaves(cls) if flag_name(f)}
    for name, value in changes.items():
        if name in direct and (dataclasses.is_dataclass(value) or not settings_section(cls, name)):
            top[name] = value
        elif name in owners or name in aliases:
            path = owners.get(name) or aliases[name]
            if len(path) == 1:  # a field of the config itself, named by its flag
                top[path[0]] = value
            else:
                by_section.setdefault(path[0], {})[".".join(path[1:])] = value
        else:
            raise ValueError(f"{cls.__name__} has no setting {name!r}")
    for section, inner in by_section.items():
        base = top.get(section, getattr(config, section))
        nested: dict[str, Any] = {}
        deeper: dict[str, dict[str, Any]] = {}
        for dotted, value in inner.items():
            head, _, rest = dotted.partition(".")
            if rest:
                deeper.setdefault(head, {})[rest.rsplit(".", 1)[-1]] = value
            else:
                nested[head] = value
        for head, values in deeper.items():
            nested[head] = replace(nested.get(head, getattr(base, head)), **values)
        top[section] = dataclasses.replace(base, **nested)
    return dataclasses.replace(config, **top)


def optional(cls: type, name: str, *, unset: str, flag: Callable[[str], str] = lambda option: option) -> type:
    """A section made from ``cls``'s: the same fields, each optional with the default None, which means
    ``unset`` (what the job's base gives); doc lines, bounds and choices kept, flags renamed by ``flag``.
    A job's flags over another config's fields (the evaluation transform over a model's stored one,
    `pipeline.data.config.EvalOverrides`) are then declared once, in ``cls``."""
    made = []
    for f in dataclasses.fields(cls):
        metadata = dict(f.metadata)
        metadata[_HELP] = f"{help_of(f)} (none: {unset}, else {shown(f.default)})"
        metadata[_FLAG] = flag(flag_name(f) or f.name)
        made.append((f.name, hints(cls)[f.name] | None, dataclasses.field(default=None, metadata=metadata)))
    return dataclasses.make_dataclass(
        name, made, frozen=True, kw_only=True, namespace={"__module__": cls.__module__}
    )


def settings_section(cls: type, name: str) -> bool:
    return is_section(hints(cls)[name])


def to_dict(config: Any) -> dict[str, Any]:
    """Plain JSON-able values, sections as nested objects; a secret as the names of what it sets, each
    ``"***"``; URLs without userinfo or query string; the class's ``CONFIG_VERSION`` (where it has one) as
    ``"version"``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif f.metadata.get("secret"):
            out[f.name] = redacted(value)
        else:
            out[f.name] = _plain(value)
    version = getattr(type(config), "CONFIG_VERSION", None)
    if version is not None:
        out["version"] = version
    return out


def from_dict(cls: type, values: dict[str, Any], **overrides: Any) -> Any:
    """Inverse of `to_dict`. Unknown keys are a one-line ValueError; a saved secret (``"***"``) becomes
    None unless ``overrides`` gives the real value; an older ``version`` goes through ``cls.migrate``."""
    values = dict(values)
    current = getattr(cls, "CONFIG_VERSION", None)
    if current is not None:
        version = values.pop("version", 1)
        if version != current:
            if not isinstance(version, int) or version > current:
                raise ValueError(
                    f"{cls.__name__} version {version!r} is newer than this vitray reads ({current}); "
                    "update vitray"
                )
            values = cls.migrate(values, version)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}; remove them or update vitray")
    kinds = hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        kind, f = kinds[name], known[name]
        if is_section(kind) and isinstance(value, dict):
            value = from_dict(kind, value)
        elif f.metadata.get("secret") and REDACTED in repr(value):
            value = None
        else:
            value = _typed(value, kind)
        kwargs[name] = value
    kwargs.update(overrides)
    return cls(**kwargs)


def _typed(value: Any, kind: Any) -> Any:
    """JSON has no tuples: a list where the field's type is a tuple becomes one."""
    if isinstance(value, list) and _is_tuple(kind):
        return tuple(value)
    return value


def _is_tuple(kind: Any) -> bool:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return any(_is_tuple(k) for k in typing.get_args(kind))
    return (typing.get_origin(kind) or kind) is tuple


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, str):
        return public_text(value)
    return value


SettingsT = typing.TypeVar("SettingsT", bound="Settings")


class Settings:
    """The base of every config dataclass of settings (a job's config, a section of one): `validate` checks
    each field against what its setting declares (`check`; a config whose checks compare fields extends
    it), `to_dict` / `from_dict` are its JSON form, `replace` a copy with settings replaced by name."""

    def validate(self) -> None:
        """A one-line ValueError for a value that cannot work."""
        check(self)

    def to_dict(self) -> dict[str, Any]:
        """`to_dict`: the JSON form, secrets redacted."""
        return to_dict(self)

    @classmethod
    def from_dict(cls: type[SettingsT], values: dict[str, Any], **overrides: Any) -> SettingsT:
        """`from_dict`: the inverse of `to_dict` (``overrides``: real values of redacted secrets)."""
        return from_dict(cls, values, **overrides)

    def replace(self: SettingsT, **changes: Any) -> SettingsT:
        """`replace`: this config with settings replaced by field or flag name, whatever section holds them."""
        return replace(self, **changes)
