"""The commands of `jobs/evaluate.py` and `jobs/analyze.py`: what each job does once its command line is
parsed (`pipeline.cli.main` ends it). The jobs' modules load with their work, not with ``--help``.
"""

from __future__ import annotations

import argparse

from pipeline import cli
from pipeline.evaluate.config import AnalyzeConfig, EvaluateConfig


def evaluate_command(args: argparse.Namespace) -> int:
    """`jobs/evaluate.py`: both outputs loaded and described, then scored (and written as JSON)."""
    from pipeline.evaluate import evaluation

    if (config := cli.configured(args, EvaluateConfig)) is None:
        return 0
    train, test = evaluation.load(config)
    print(f"train: {train.describe()}\ntest:  {test.describe()}\n", flush=True)
    cli.start_work()
    report = evaluation.evaluate(config, train, test)
    print(report.format())
    if config.json:
        evaluation.write_json(report, config.location(config.json))
        print(f"\nwrote {config.json}")
    return 0


def analyze_command(args: argparse.Namespace) -> int:
    """`jobs/analyze.py`: the figures and analysis.json of `pipeline.evaluate.inspection.analyze`."""
    from pipeline.evaluate import inspection

    if (config := cli.configured(args, AnalyzeConfig)) is not None:
        print(inspection.analyze(config, begin=cli.start_work).format())
    return 0
