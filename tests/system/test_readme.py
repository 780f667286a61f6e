"""The README stays true and short: the quickstart is the Makefile's, its python examples run, it counts the
jobs there are, and it reads in about ten minutes (every option of every job: docs/options.md,
tests/system/test_docs.py; the reference: docs/design.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_quickstart_is_the_two_make_commands():
    quickstart = README.split("## Quickstart", 1)[1].split("##", 1)[0]
    block = quickstart.split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test", "lint"):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), f"Makefile has no {target} target"
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_ten_minute_read():
    # Reference paragraphs belong in docs/design.md; the README says what each job is for and points there.
    assert len(README.split()) < 2600, f"README.md has {len(README.split())} words; move reference to docs/"


def test_readme_counts_the_jobs_there_are():
    from tests.job_scripts import load_job

    jobs = load_job("docs").JOBS  # the jobs docs/options.md documents
    counted = ("One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten", "Eleven")[
        len(jobs) - 1
    ]
    assert f"{counted} jobs, each a script in `jobs/`" in README
    assert all(f"`{name}`" in README.split("## The jobs", 1)[1].split("##", 1)[0] for name, _, _ in jobs)


def test_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    assert blocks, "the README has no python example"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, "README.md", "exec"), namespace)
    # The model example's comments state these shapes.
    assert namespace["tokens"].shape == (2, 577, 384)
    assert namespace["emb"].shape == (2, 384)
    assert namespace["logits"].shape == (2, 10)


def test_slow_tests_outlive_their_own_subprocess_timeouts():
    from tests.conftest import SLOW_TEST_TIMEOUT_S

    longest = max(
        int(t) for f in (ROOT / "tests").rglob("*.py") for t in re.findall(r"timeout=(\d+)", f.read_text())
    )
    assert longest < SLOW_TEST_TIMEOUT_S, f"a subprocess may wait {longest} s, longer than pytest allows"
