"""Rewrite the generated parts of docs/ (`make docs`): the options reference and the layout.

    python jobs/docs.py            # rewrite docs/options.md and the layout in docs/design.md
    python jobs/docs.py --check    # exit 1 if either differs from what the code says

docs/options.md is written from the jobs' own parsers: every option becomes one table row (the option,
its value, its default, its help line); a default that the help states (``(default: X)``, which
`pipeline.cli.add_settings` appends from a preset or the config's defaults) moves into the default
column. The layout in docs/design.md (between its ``layout`` markers) is written from the module
docstrings: each package and module of vit/, pipeline/ and jobs/ with its docstring's first sentence,
so a module cannot be missing from it and its line is edited where the module is. tests/system/test_docs.py
fails while either is stale. Docs generation only: no job imports this file.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline.compat import parser_options
from pipeline.data.make_shards import parser as make_shards_parser
from pipeline.embed.config import parser as embed_parser
from pipeline.evaluate.config import analyze_parser, evaluate_parser
from pipeline.export import export_parser
from pipeline.index.config import index_parser, search_parser
from pipeline.train.audit import audit_parser
from pipeline.train.presets import finetune_parser, pretrain_parser

ROOT = Path(__file__).resolve().parents[1]
PATH = "docs/options.md"  # every option of every job

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
    ("audit", "A training run's ledger against its shards: each sample of each epoch trained once (one process, no Ray).", audit_parser),
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


# --- the layout in docs/design.md ---------------------------------------------------------------------

DESIGN = "docs/design.md"  # its layout block, between these markers, is written here
LAYOUT_BEGIN = "<!-- layout: written by `make docs` (jobs/docs.py) from the module docstrings; edit those -->"
LAYOUT_END = "<!-- /layout -->"
PACKAGES = ("vit", "pipeline", "jobs")
# The folders that hold no Python of the project's packages, and jobs/ (scripts, no package docstring).
FOLDERS = {
    "jobs": "the job scripts, each one call `pipeline.cli.main(parser, command)`; docs generation; benchmarks",
    "docs": "this reference; options.md and the layout above are generated (`make docs`)",
    "cluster": "Ray cluster launcher configs, a KubeRay RayJob and its image, runtime_env.yaml",
    "tests": "pytest, mirroring the packages, plus system/ for the end-to-end runs; on a 2-core CPU "
    "machine with a local Ray",
}
WIDTH = 110  # the docs' line width
NAME_COLUMN = 24


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, as the layout shows it."""
    text = ast.get_docstring(ast.parse(path.read_text()))
    if not text:
        raise ValueError(
            f"{path.relative_to(ROOT)} has no docstring; its first sentence is its line in {DESIGN}"
        )
    first = " ".join(text.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", first, maxsplit=1)[0]
    return sentence.replace("``", "`").rstrip(".")


def _entry(depth: int, name: str, text: str) -> list[str]:
    head = "  " * depth + name
    column = max(NAME_COLUMN, len(head) + 2)
    return textwrap.wrap(
        text, WIDTH, initial_indent=head.ljust(column), subsequent_indent=" " * column, break_on_hyphens=False
    )


def _tree(folder: Path, depth: int) -> list[str]:
    """Each module of ``folder`` (files first), then each package below it with its own modules."""
    lines: list[str] = []
    files = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p for p in folder.iterdir() if (p / "__init__.py").exists())
    for path in files:
        lines += _entry(depth, path.name, summary(path))
    for package in packages:
        lines += _entry(depth, package.name + "/", summary(package / "__init__.py"))
        lines += _tree(package, depth + 1)
    return lines


def layout() -> str:
    """The layout block of docs/design.md, markers included."""
    lines: list[str] = []
    for name in (*PACKAGES, "docs", "cluster", "tests"):
        init = ROOT / name / "__init__.py"
        lines += _entry(0, name + "/", summary(init) if name != "tests" and init.exists() else FOLDERS[name])
        if name in PACKAGES:
            lines += _tree(ROOT / name, 1)
    return "\n".join([LAYOUT_BEGIN, "```", *lines, "```", LAYOUT_END])


def design_markdown() -> str:
    """The whole of docs/design.md, its layout block rewritten."""
    text = (ROOT / DESIGN).read_text()
    if LAYOUT_BEGIN not in text or LAYOUT_END not in text:
        raise ValueError(f"{DESIGN} has lost its layout markers ({LAYOUT_BEGIN} ... {LAYOUT_END})")
    before, rest = text.split(LAYOUT_BEGIN, 1)
    return before + layout() + rest.split(LAYOUT_END, 1)[1]


def generated() -> dict[str, str]:
    """Each generated file (its path under the repository) and what it should hold."""
    return {PATH: markdown(), DESIGN: design_markdown()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if a file differs")
    args = parser.parse_args(argv)
    files = generated()
    stale = [name for name, text in files.items() if (ROOT / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"error: {name} differs from the code it is written from; run make docs", file=sys.stderr)
        if not stale:
            print(f"{', '.join(files)} are up to date")
        return 1 if stale else 0
    for name in stale:
        (ROOT / name).write_text(files[name])
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
