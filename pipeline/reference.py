"""The options reference (docs/options.md), written from the jobs' own parsers so it cannot drift.

Every job's parser is built here as its job builds it, and each option becomes one table row: the
option, its value (metavar or choices), its default and its help line. A default that the help states
(``(default: X)``, which `pipeline.cli.add_settings` appends from a preset or the config's defaults)
moves into the default column. `python jobs/docs.py` (`make docs`) rewrites the file; a test compares
the file with `markdown()`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from pipeline.compat import parser_options
from pipeline.data.make_shards import parser as make_shards_parser
from pipeline.embed.config import parser as embed_parser
from pipeline.evaluate.config import analyze_parser, evaluate_parser
from pipeline.export import export_parser
from pipeline.index.config import index_parser, search_parser
from pipeline.train.presets import finetune_parser, pretrain_parser

PATH = "docs/options.md"

# (job, what it does, its parser), in the order a user meets them.
JOBS: tuple[tuple[str, str, Callable[[], argparse.ArgumentParser]], ...] = (
    ("make_shards", "WebDataset shards from an image folder or from synthetic classes.", make_shards_parser),
    ("pretrain", "Pretraining on Ray Train + FSDP2. Defaults: the `tiny` preset's.", pretrain_parser),
    ("finetune", "Fine-tuning pretrained weights. Defaults: the `finetune` preset's.", finetune_parser),
    ("embed", "A model's embeddings of shards, to Parquet (Ray Data).", embed_parser),
    ("evaluate", "Linear probe, k-NN and few-shot scores of two embedding outputs (one process, no Ray).", evaluate_parser),
    ("index", "A FAISS index over embedding outputs: exact, HNSW or IVF-PQ (one process, no Ray).", index_parser),
    ("search", "Nearest rows to keys or an image, and near-duplicate pairs, from an index (one process, no Ray).", search_parser),
    ("analyze", "The paper's Fig. 7 panels of any weights (one process, no Ray).", analyze_parser),
    ("export", "A trained model as files timm or transformers load, with a model card (one process, no Ray).", export_parser),
)  # fmt: skip

HEADER = """\
# Options of every job

Written by `make docs` (`python jobs/docs.py`) from the jobs' parsers: edit the setting's doc line
(docs/design.md, "Settings"), not this file; a test fails when the two differ. `--help` prints the same.
A bool setting is a pair of switches, `--x` / `--no-x`; an optional value takes `none` to unset it.
The guide to each job is the README; what a preset is, `pipeline/train/presets.py`.
"""

_STATED_DEFAULT = re.compile(r"\s*\(default: (.*)\)$")


def options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` but ``-h`` / ``--help``, in the parser's order."""
    return [o for action in parser_options(parser) for o in action.option_strings]


def rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(option, value, default, help) for each option of ``parser``, as Markdown table cells."""
    found = []
    for action in parser_options(parser):
        text = (action.help or "") % dict(vars(action), prog=parser.prog)  # argparse's %(default)s
        default = ""
        stated = _STATED_DEFAULT.search(text)
        if stated:
            default, text = stated.group(1), text[: stated.start()]
        elif action.default not in (None, False, argparse.SUPPRESS):
            default = str(action.default)
        if action.required:
            default = "required"
        elif default == "":
            default = "none" if action.nargs != 0 else ""
        option = ", ".join(f"`{o}`" for o in action.option_strings)
        found.append((option, _cell(_value(action)), _cell(default), _prose(text)))
    return found


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch
        return ""
    if action.metavar:
        return str(action.metavar)
    if action.choices:
        return "|".join(str(c) for c in action.choices)
    return action.dest.upper()


def _prose(text: str) -> str:
    """Help text as a table cell: one line, and nothing Markdown would take for a tag, an emphasis or
    a column (``<field>``, ``checkpoint_*``, ``a|b``)."""
    text = " ".join(text.split())
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _cell(text: str) -> str:
    """A value or default: as code when it is one word, else as prose."""
    if not text or " " in text:
        return _prose(text)
    return "`" + text.replace("|", "\\|") + "`"


def job_markdown(name: str, summary: str, parser: argparse.ArgumentParser) -> str:
    lines = [
        f"## {name}",
        "",
        f"`python jobs/{name}.py`: {summary}",
        "",
        "| option | value | default | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| {option} | {value} | {default} | {text} |" for option, value, default, text in rows(parser)]
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The whole of docs/options.md."""
    index = " · ".join(f"[{name}](#{name})" for name, _, _ in JOBS)
    parts = [HEADER, index + "\n"]
    parts += [job_markdown(name, summary, make()) for name, summary, make in JOBS]
    return "\n".join(parts)
