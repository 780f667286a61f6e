"""jobs/evaluate.py end to end on Parquet files written with the embedding job's own table builder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.embed.output import FORMAT, MANIFEST, METADATA_KEY, embedding_table
from pipeline.embed.reader import load_embeddings
from tests.job_scripts import load_job

ROOT = Path(__file__).resolve().parents[2]
evaluate_job = load_job("evaluate")  # the job script itself, run in this process (its output captured)


HEADER = {
    "format": FORMAT,
    "model": {"name": "vit_tiny_test"},
    "weights": {"sha256": "ab" * 32},
    "preprocessing": {"crop_fraction": 0.875},
}


def write_output(
    directory: Path,
    features: np.ndarray,
    labels: np.ndarray,
    *,
    files: int = 2,
    prefix: str = "",
    header: dict | None = None,
) -> Path:
    """An output as jobs/embed.py leaves it: ``files`` Parquet files and a manifest listing them
    (``prefix``: before each file's name, as older versions named some; ``header``: in place of HEADER)."""
    directory.mkdir(parents=True, exist_ok=True)
    header = header or HEADER
    shards = {}
    for i, (x, y) in enumerate(
        zip(np.array_split(features, files), np.array_split(labels, files), strict=True)
    ):
        name = f"{prefix}part-{i:06d}.parquet"
        keys = [f"{i}-{j}" for j in range(len(y))]
        shard = f"{directory.name}/shard-{i}.tar"  # each output its own shards, as a held-out split
        table = embedding_table(keys, [shard] * len(y), x, y, {**header, "shard": {"url": shard}})
        pq.write_table(table, directory / name)
        shards[shard] = {"file": name, "rows": len(y)}
    (directory / MANIFEST).write_text(json.dumps({**header, "shards": shards}))
    return directory


def clustered(labels: np.ndarray, dim: int = 6, seed: int = 0) -> np.ndarray:
    """One direction per class (a one-hot), plus noise far too small to move a row to another class."""
    rng = np.random.default_rng(seed)
    return np.eye(dim)[labels] + 0.01 * rng.normal(size=(len(labels), dim))


def test_a_known_case_gives_the_hand_computed_accuracies(tmp_path, capsys):
    # Three well-separated classes, 10 training rows each. The test set has 4 rows, one of which
    # carries a wrong label (its embedding lies in class 0's direction, its label says 2): every
    # classifier gets the 3 others right and that one wrong, 75%. 25 shots exceed 10 rows per class.
    train_y = np.repeat([0, 1, 2], 10)
    test_y_true = np.array([0, 1, 2, 0])
    test_y = np.array([0, 1, 2, 2])
    train = write_output(tmp_path / "train", clustered(train_y), train_y)
    test = write_output(tmp_path / "test", clustered(test_y_true, seed=1), test_y, files=1)
    (train / "stray.parquet").write_bytes(b"not listed by the manifest, so never read")
    out = tmp_path / "scores.json"
    args = f"--train {train} --test {test} --k 5 --shots 1,5,10,25 --seeds 3 --json {out}"
    code = evaluate_job.main(args.split())
    printed = capsys.readouterr().out
    assert code == 0
    scores = json.loads(out.read_text())
    assert scores["train"]["rows"] == 30 and scores["test"]["rows"] == 4 and scores["train"]["dim"] == 6
    assert scores["linear_probe"]["accuracy"] == 0.75
    assert scores["knn"] == {"accuracy": 0.75, "k": 5, "vote": "majority"}
    for shots in ("1", "5", "10"):
        assert scores["few_shot"][shots]["per_seed"] == [0.75, 0.75, 0.75]
        assert scores["few_shot"][shots]["mean"] == 0.75
    assert "fewer than 25 shots" in scores["few_shot"]["25"]["skipped"]
    assert "75.00%" in printed and "k-NN (k=5, cosine, majority)" in printed and "25-shot" in printed


def test_reads_back_exactly_what_was_written(tmp_path):
    labels = np.arange(7) % 3
    features = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    loaded = load_embeddings(str(write_output(tmp_path / "o", features, labels, files=3)))
    order = np.argsort([int(k.replace("-", "")) for k in loaded.keys])  # files sorted by name: same order
    np.testing.assert_array_equal(loaded.features[order], features)
    np.testing.assert_array_equal(loaded.labels[order], labels)
    assert loaded.model == "vit_tiny_test" and loaded.dim == 5


@pytest.mark.parametrize(
    ("about", "message"),
    [
        ({"weights": {"sha256": "cd" * 32}}, "weights sha256 abab"),
        (
            {"preprocessing": {"crop_fraction": 0.5}},
            "preprocessing crop_fraction 0.875 in _manifest.json, 0.5",
        ),
    ],
)
def test_an_output_whose_files_disagree_is_refused_not_scored(tmp_path, capsys, about, message):
    # A second run of other weights or another eval transform into the same --out left one of its
    # files there: the output holds two models' embeddings and would score as their mixture.
    labels = np.repeat([0, 1, 2], 10)
    train = write_output(tmp_path / "train", clustered(labels), labels)
    test = write_output(tmp_path / "test", clustered(labels, seed=1), labels)
    path = train / "part-000001.parquet"
    table = pq.read_table(path)
    footer = {**json.loads(table.schema.metadata[METADATA_KEY]), **about}
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(footer).encode()}), path)
    assert evaluate_job.main(["--train", str(train), "--test", str(test)]) == 2
    err = capsys.readouterr().err.strip()
    assert "mixes embeddings of two configurations" in err and message in err and "\n" not in err
    assert "part-000001.parquet" in err and "--overwrite" in err


def test_a_test_split_embedded_from_training_shards_is_refused(tmp_path, capsys):
    labels = np.repeat([0, 1, 2], 10)
    train = write_output(tmp_path / "train", clustered(labels), labels, files=3)
    for test in (train, tmp_path / "train-copy"):  # the same output, or another of the same shards
        if test != train:
            shutil.copytree(train, test)
        assert evaluate_job.main(["--train", str(train), "--test", str(test)]) == 2
        err = capsys.readouterr().err
        assert err == (
            "error: --train and --test were embedded from 3 of the same shards (first: train/shard-0.tar): "
            "the test would score images the classifier trained on; embed a held-out split for --test\n"
        )


def test_a_normalized_split_against_a_plain_one_is_refused(tmp_path, capsys):
    # Unit-length training rows against plain test rows were scored, exit 0.
    labels = np.repeat([0, 1, 2], 10)
    unit = {**HEADER, "output": {"normalize": True, "dtype": "float32"}}
    x = clustered(labels)
    normalized = write_output(
        tmp_path / "unit", x / np.linalg.norm(x, axis=1, keepdims=True), labels, header=unit
    )
    plain = write_output(tmp_path / "plain", x, labels)
    for train, test, unit_flag, plain_flag in (
        (normalized, plain, "--train", "--test"),
        (plain, normalized, "--test", "--train"),
    ):
        assert evaluate_job.main(["--train", str(train), "--test", str(test)]) == 2
        assert capsys.readouterr().err == (
            f"error: {unit_flag} was embedded with --normalize (unit-length rows) and {plain_flag} without; "
            "embed both with the same --normalize\n"
        )
    both = write_output(
        tmp_path / "unit-test", x / np.linalg.norm(x, axis=1, keepdims=True), labels, header=unit
    )
    assert evaluate_job.main(["--train", str(normalized), "--test", str(both)]) == 0


def test_an_output_that_an_older_version_named_for_readers_to_skip_still_loads(tmp_path):
    labels = np.repeat([0, 1, 2], 2)
    out = write_output(tmp_path / "o", clustered(labels), labels, prefix="_")  # _part-000000.parquet ...
    assert sorted(load_embeddings(str(out)).keys) == sorted(f"{i}-{j}" for i in range(2) for j in range(3))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("unlabeled", "rows have no label; evaluation needs labeled embeddings"),
        ("width", "--train has D = 6 but --test D = 4"),
        ("missing", "does not exist; pass a directory that jobs/embed.py wrote"),
        ("one_class", "holds one class only"),
        ("big_k", "--k 50 is more than the 30 --train rows"),
        # scikit-learn's own message for this is several lines long
        ("nan", "--train %TRAIN: 2 of 30 rows hold NaN or inf (first: key 0-3)"),
        ("json_not_ours", "exists and is no evaluation report; pass --overwrite"),
        ("json_dir", "is a directory; name a file"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, change, message):
    train_y = np.repeat([0, 1, 2], 10)
    train_x = clustered(train_y)
    test_y, test_x = train_y.copy(), train_x
    if change == "unlabeled":
        test_y = np.where(np.arange(30) < 3, -1, test_y)  # -1: no label (a null in the Parquet column)
    if change == "width":
        test_x = train_x[:, :4]
    if change == "one_class":
        train_y = np.zeros(30, dtype=np.int64)
    if change == "nan":
        train_x = train_x.copy()
        train_x[[3, 20], 1] = np.nan
    train = write_output(tmp_path / "train", train_x, train_y)
    test = write_output(tmp_path / "test", test_x, test_y)
    args = ["--train", str(train), "--test", str(tmp_path / "nowhere" if change == "missing" else test)]
    if change == "big_k":
        args += ["--k", "50"]
    if change == "json_not_ours":
        (tmp_path / "notes.json").write_text('{"mine": 1}')
        args += ["--json", str(tmp_path / "notes.json")]
    if change == "json_dir":
        args += ["--json", str(tmp_path)]
    assert evaluate_job.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message.replace("%TRAIN", str(train)) in err and "\n" not in err
    if change == "json_not_ours":
        assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'
        assert evaluate_job.main([*args, "--overwrite"]) == 0  # replaced on request
        assert "linear_probe" in json.loads((tmp_path / "notes.json").read_text())


def test_print_config_shows_the_resolved_configuration(capsys):
    assert evaluate_job.main(["--train", "a", "--test", "b", "--shots", "2,4", "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["shots"] == [2, 4] and config["k"] == 20 and config["train"] == "a"


@pytest.mark.slow  # 20 fresh interpreters: the abort came in about one exit of six
def test_a_process_that_read_an_output_exits_cleanly(tmp_path):
    # pyarrow's reader threads used to drop their last hold on the file after the read returned, and
    # letting go of Python's bytes takes the GIL: a process exiting right then aborted (exit code 134,
    # "terminate called without an active exception") in about one run of six, its work done.
    labels = np.repeat([0, 1], 4)
    out = write_output(tmp_path / "o", clustered(labels), labels, files=1)
    code = f"from pipeline.embed.reader import load_embeddings; load_embeddings({str(out)!r})"
    runs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for _ in range(20)
    ]
    ends = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    assert [c for c, _ in ends] == [0] * len(ends), [e for c, e in ends if c]
