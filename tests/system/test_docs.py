"""docs/ stays true: docs/options.md is what the jobs' parsers say and the layout in docs/design.md what the
module docstrings say (`make docs` writes both), every option of every job is in the reference, and every
link between the README and docs/ leads to a file. No Ray."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.job_scripts import load_job

reference = load_job("docs")  # jobs/docs.py, which writes the generated docs
ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ROOT / reference.PATH
JOBS = [name for name, _, _ in reference.JOBS]


def documented(option: str, text: str) -> bool:
    """``option`` appears whole, as code: "`--cpus-per-worker" does not stand for "--cpu"."""
    return re.search(rf"`{re.escape(option)}(?![a-z-])", text) is not None


def help_options(text: str) -> set[str]:
    """The options ``--help`` lists: the invocation at the start of each entry, not options its help
    text mentions (finetune's ``--label-key`` help names ``--objective``, which finetune lacks)."""
    entries = [re.split(r"\s{2,}", line.strip())[0] for line in text.splitlines() if line.startswith("  -")]
    return {o for entry in entries for o in re.findall(r"--[a-z][a-z0-9-]*", entry)} - {"--help"}


def test_options_reference_is_what_the_parsers_say():
    assert OPTIONS.read_text() == reference.markdown(), (
        f"{reference.PATH} differs from the jobs' parsers: run make docs (python jobs/docs.py)"
    )


@pytest.mark.parametrize("job", JOBS)
def test_every_option_of_a_job_is_in_the_reference(job):
    # The job as it runs: its own --help, so an option a job adds past the library's parser counts too.
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / f"{job}.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    options = help_options(result.stdout)
    section = OPTIONS.read_text().split(f"\n## {job}\n", 1)[1].split("\n## ", 1)[0]
    missing = sorted(o for o in options if not documented(o, section))
    assert not missing, f"{reference.PATH} lacks these options of jobs/{job}.py: {missing}; run make docs"
    assert options == set(reference.options(dict((n, p) for n, _, p in reference.JOBS)[job]()))


def test_layout_is_what_the_module_docstrings_say():
    assert (ROOT / reference.DESIGN).read_text() == reference.design_markdown(), (
        f"the layout in {reference.DESIGN} differs from the module docstrings: run make docs"
    )


def test_the_layout_lists_every_module_and_a_new_one_at_once(tmp_path, monkeypatch):
    block = reference.layout()
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        if path.name != "__init__.py":
            assert f" {path.name} " in block, path
    # A module added to a room is in the next layout, under its room, with its docstring's first sentence.
    room = tmp_path / "pipeline" / "data"
    room.mkdir(parents=True)
    (tmp_path / "pipeline" / "__init__.py").write_text('"""The rooms."""\n')
    (room / "__init__.py").write_text('"""Shards to rows."""\n')
    (room / "fresh.py").write_text('"""A fresh module: what it holds. More detail here."""\n')
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setattr(reference, "PACKAGES", ("pipeline",))
    monkeypatch.setattr(reference, "FOLDERS", {"docs": "d", "cluster": "c", "tests": "t"})
    lines = reference.layout().splitlines()
    assert lines[lines.index("  data/                 Shards to rows") + 1] == (
        "    fresh.py            A fresh module: what it holds"
    )
    (room / "bare.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"bare\.py has no docstring"):
        reference.layout()


def test_help_reader_takes_invocations_only():
    text = "options:\n  --hflip, --no-hflip   flips (see --objective)\n  --storage-options STORAGE_OPTIONS\n   x\n"
    assert help_options(text) == {"--hflip", "--no-hflip", "--storage-options"}


def test_option_check_takes_whole_options_only():
    assert documented("--cpus-per-worker", "| `--cpus-per-worker` |")
    assert not documented("--cpu", "| `--cpus-per-worker` |")


def test_reference_cells_stay_in_their_columns():
    # A `|` in a help line or a choice list would open a column of its own.
    for line in OPTIONS.read_text().splitlines():
        if line.startswith("| `--"):
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_links_lead_to_files(page):
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    broken = [link for link in links if "://" not in link and not (path.parent / link).exists()]
    assert not broken, f"{page} links to files that do not exist: {broken}"
