"""Score embedding outputs: linear-probe, k-NN and few-shot linear accuracy, as a table and as JSON.

    python jobs/evaluate.py --train /tmp/emb-train --test /tmp/emb-val                 # one process, no Ray
    python jobs/evaluate.py --train s3://b/emb/train --test s3://b/emb/val --json /tmp/scores.json

--train and --test are directories that jobs/embed.py wrote (or single .parquet files with its
columns), from labeled shards and the same weights. Classifiers are fitted on --train and scored on
--test: a logistic-regression probe on standardized features, a k-NN majority vote among the --k most
cosine-similar rows, and the paper's few-shot linear accuracy (regularized least squares onto {-1, 1}
targets from --shots images per class, averaged over --seeds draws).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from pipeline import cli
from pipeline.evaluate.config import EvaluateConfig, shot_list

FLAGS = [
    cli.Flag(
        "train", "embedding output to fit on (jobs/embed.py's --out, or a .parquet file)", required=True
    ),
    cli.Flag("test", "embedding output to score on", required=True),
    cli.Flag("json", "also write the figures to this JSON file (local, s3://, gs://)"),
    cli.Flag("k", "neighbours in the k-NN vote (cosine similarity, one vote each)"),
    cli.Flag("shots", "few-shot sizes, images per class, comma-separated", type=shot_list, metavar="N,N,..."),
    cli.Flag("seeds", "few-shot draws per size, averaged"),
    cli.Flag("l2_reg", "few-shot ridge penalty"),
    cli.Flag("probe_c", "inverse L2 strength of the logistic-regression probe"),
    cli.Flag("probe_max_iter", "L-BFGS iterations of the probe"),
    cli.Flag("storage_options", "fsspec options as JSON (credentials: prefer the environment)"),
    cli.Flag("overwrite", "replace a --json file that is no evaluation report"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jobs/evaluate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cli.add_flags(parser, EvaluateConfig, FLAGS, defaults=EvaluateConfig(train="", test=""))
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved configuration as JSON and exit"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from pipeline.evaluate import evaluation

        config = EvaluateConfig(**cli.overrides(args, FLAGS))
        if args.print_config:
            cli.print_config(config)
            return 0
        train, test = evaluation.load(config)
        print(f"train: {train.describe()}\ntest:  {test.describe()}\n", flush=True)
        cli.start_work()
        report = evaluation.evaluate(config, train, test)
        print(report.format())
        if config.json:
            evaluation.write_json(report, config.json, config.storage_options)
            print(f"\nwrote {config.json}")
        return 0

    return cli.run_job(body)


if __name__ == "__main__":
    sys.exit(main())
