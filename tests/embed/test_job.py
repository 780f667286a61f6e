"""The embedding job: exact rows, the same embeddings as the model in process, atomic commits and resumes.

Units first (no Ray): the actor's batch function, staged commits (output names: test_output.py). Then
whole runs on the shared local Ray over tiny shards with the tiny model (each run starts one model actor).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import vit
from pipeline import storage
from pipeline.data.bad_samples import BadSampleBudgetError, reason_category
from pipeline.data.config import DataConfig
from pipeline.data.synthetic import encode, render
from pipeline.data.tar import iter_samples
from pipeline.data.writing import tar_bytes
from pipeline.embed.actor import embed_rows
from pipeline.embed.config import EmbedConfig
from pipeline.embed.identity import CLAIM
from pipeline.embed.job import prepare, run, run_in_process
from pipeline.embed.output import MANIFEST, METADATA_KEY, RECORDS, output_name
from tests.job_scripts import load_job
from tests.signed_http import SignedStore

ROOT = Path(__file__).resolve().parents[2]
TINY = "vit_tiny_test"
D = 64
# The job script itself, run in this process where it needs no Ray (its output captured).
embed_job = load_job("embed")


def trained_model(seed: int = 0) -> vit.VisionTransformer:
    torch.manual_seed(seed)
    model = vit.create_model(TINY, num_classes=4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A vitray export as training writes it (its DataConfig under "preprocessing", with an eval crop
    and resampling of its own), and its model."""
    model = trained_model()
    path = tmp_path_factory.mktemp("export")
    data = DataConfig(image_size=32, patch_size=8, crop_fraction=0.75, eval_interpolation="bilinear")
    vit.save_pretrained(path, model.state_dict(), model.config, extra={"preprocessing": data.to_dict()})
    return str(path), model


def images_by_key(urls: list[str]) -> dict[str, bytes]:
    out = {}
    for url in urls:
        with open(url, "rb") as f:
            out.update({s.key: s.members["jpg"] for s in iter_samples(f) if "jpg" in s.members})
    return out


def read_rows(out: str | Path) -> dict[str, np.ndarray]:
    table = pq.read_table(str(out))  # the directory: _manifest.json and hidden names are skipped
    return {
        "key": np.array(table["key"].to_pylist()),
        "embedding": np.array(table["embedding"].to_pylist(), dtype=np.float32),
        "label": np.array(table["label"].to_pylist(), dtype=object),
    }


def manifest(out: str | Path) -> dict:
    return json.loads((Path(out) / MANIFEST).read_text())


# --- without Ray -------------------------------------------------------------------------------


def test_the_embedding_modules_import_without_ray():
    # A bare GPU machine runs the naive half of `benchmark.py embed` with these and no Ray.
    code = "import sys; sys.modules['ray'] = None; import pipeline.embed, pipeline.embed.actor, pipeline.embed.output"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})


def test_batch_function_skips_error_rows_and_does_not_depend_on_batching():
    model = trained_model()
    rng = np.random.default_rng(0)
    patches = rng.integers(0, 256, (7, 16, 192), dtype=np.uint8)
    errors = np.array(["", "", "undecodable image: x", "", "", "", "empty image: y"], dtype=object)
    batch = {
        "key": np.array([f"k{i}" for i in range(7)], dtype=object),
        "url": np.array(["u"] * 7, dtype=object),
        "patches": patches,
        "label": np.arange(7),
        "error": errors,
    }
    seen = []
    original = model.embed
    model.embed = lambda x, **kw: seen.append(len(x)) or original(x, **kw)
    out = embed_rows(model, batch, batch_size=4)
    assert seen == [4, 4]  # 5 good rows in two padded chunks; error rows never reach the model
    assert out["embedding"].shape == (7, D) and out["embedding"].dtype == np.float32
    assert not out["embedding"][[2, 6]].any()
    assert list(out["error"]) == list(errors) and list(out["key"]) == list(batch["key"])
    with torch.no_grad():
        direct = original(torch.from_numpy(patches)).numpy()
    good = [0, 1, 3, 4, 5]
    np.testing.assert_allclose(out["embedding"][good], direct[good], rtol=1e-5, atol=1e-5)
    # Every forward has the same shape, so a row's embedding is the same bits in any company.
    alone = {k: v[[4]] for k, v in batch.items()}
    np.testing.assert_array_equal(embed_rows(model, alone, batch_size=4)["embedding"][0], out["embedding"][4])
    pre = embed_rows(model, batch, batch_size=4, pre_logits=True)["embedding"]
    with torch.no_grad():
        np.testing.assert_allclose(
            pre[good], original(torch.from_numpy(patches[good]), pre_logits=True), atol=1e-5
        )


def test_staged_file_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "out" / "a.parquet"
    with pytest.raises(RuntimeError), storage.staged_file(str(target)) as local:
        Path(local).write_bytes(b"half")
        raise RuntimeError("crash while writing")
    assert not target.exists() and list((tmp_path / "out").iterdir()) == []
    with storage.staged_file(str(target)) as local:
        assert storage.is_temporary(Path(local).name) and Path(local).name.startswith(".")
        Path(local).write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and storage.list_files(str(tmp_path / "out")) == {"a.parquet": 5}


# --- whole runs on Ray -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def first_run(ray_session, synthetic_shards, export, tmp_path_factory):
    out = tmp_path_factory.mktemp("emb") / "out"
    config = EmbedConfig(data=synthetic_shards.brace_url, weights=export[0], out=str(out), batch_size=8)
    summary = run(prepare(config))
    return config, summary


def test_rows_equal_the_model_in_process_and_read_with_common_tools(first_run, synthetic_shards, export):
    config, summary = first_run
    _, model = export
    rows = read_rows(config.out)
    assert sorted(rows["key"]) == synthetic_shards.keys and len(set(rows["key"])) == len(rows["key"])
    assert rows["embedding"].shape == (48, D) and np.isfinite(rows["embedding"]).all()
    assert [rows["label"][i] for i in range(48)] == [synthetic_shards.labels[k] for k in rows["key"]]
    assert (summary.committed, summary.rows, summary.bad_samples["bad"]) == (4, 48, 0)

    # The export's eval transform, written out here rather than taken from the job: the center
    # 0.75 of the short side, resized to 32 px with a bilinear filter.
    def expected_pixels(data: bytes) -> np.ndarray:
        im = Image.open(io.BytesIO(data)).convert("RGB")
        side = min(im.size) * 0.75
        left, top = (im.width - side) / 2, (im.height - side) / 2
        box = (left, top, left + side, top + side)
        return np.asarray(im.resize((32, 32), Image.Resampling.BILINEAR, box=box))

    images = images_by_key(synthetic_shards.urls)
    pixels = np.stack([expected_pixels(images[k]) for k in rows["key"]])
    with torch.no_grad():
        direct = model.embed(vit.patchify(torch.from_numpy(pixels), 8)).numpy()
    np.testing.assert_allclose(rows["embedding"], direct, rtol=1e-5, atol=1e-5)

    first = pq.read_table(Path(config.out) / output_name(synthetic_shards.urls[0]))
    assert str(first.schema.field("embedding").type) == f"fixed_size_list<element: float>[{D}]"
    about = json.loads(first.schema.metadata[METADATA_KEY])
    assert about["shard"] == {"url": synthetic_shards.urls[0], "rows": 12, "skipped": []}
    assert about["model"]["name"] == TINY and about["dim"] == D and about["image_size"] == 32

    import duckdb
    import pandas as pd

    frame = pd.read_parquet(config.out)
    assert len(frame) == 48 and len(frame["embedding"].iloc[0]) == D
    got = duckdb.sql(
        f"SELECT count(*), count(DISTINCT key), max(len(embedding)) FROM '{config.out}/*.parquet'"
    )
    assert got.fetchall() == [(48, 48, D)]

    m = manifest(config.out)
    assert m["weights"]["sha256"] == prepare(config).source.sha256 and m["dim"] == D
    assert m["model"]["config"] == model.config.to_dict() and m["preprocessing"]["image_size"] == 32
    assert (m["preprocessing"]["crop_fraction"], m["preprocessing"]["eval_interpolation"]) == (
        0.75,
        "bilinear",
    )
    assert [m["shards"][u]["rows"] for u in synthetic_shards.urls] == [12] * 4


def test_rerun_skips_committed_shards_and_overwrite_reproduces_the_same_bits(first_run, synthetic_shards):
    config, _ = first_run
    before = read_rows(config.out)
    again = run(prepare(config))
    assert (again.committed, again.already_done, again.rows_in_output) == (0, 4, 48)
    # A run over part of the shards keeps what earlier runs committed for the others.
    part = run(prepare(config.replace(data=synthetic_shards.urls[0])))
    assert (part.committed, part.already_done, part.rows_in_output) == (0, 1, 48)
    assert len(manifest(config.out)["shards"]) == 4
    redo = run(prepare(config.replace(overwrite=True)))
    assert redo.committed == 4
    after = read_rows(config.out)
    assert list(after["key"]) == list(before["key"])
    np.testing.assert_array_equal(after["embedding"], before["embedding"])  # same command, same bits


def test_other_weights_into_the_same_output_fail_unless_overwrite(first_run, tmp_path):
    config, _ = first_run
    other = trained_model(seed=1)
    vit.save_pretrained(tmp_path, other.state_dict(), other.config)
    with pytest.raises(
        ValueError, match=r"holds embeddings of another configuration.*weights sha256"
    ) as info:
        prepare(config.replace(weights=str(tmp_path)))
    assert "--overwrite" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="embedding cls there, pre_logits now"):
        prepare(config.replace(embedding="pre_logits"))
    # The same weights through another eval transform would mix two kinds of rows in one output.
    with pytest.raises(ValueError, match=r"preprocessing crop_fraction 0\.75 there, 0\.875 now"):
        prepare(config.replace(crop_fraction=0.875))
    with pytest.raises(ValueError, match="preprocessing eval_interpolation 'bilinear' there, 'bicubic' now"):
        prepare(config.replace(interpolation="bicubic"))
    assert prepare(config.replace(weights=str(tmp_path), overwrite=True)).work.pending  # allowed, not run
    # Native-aspect rows are another kind of row: no output holds both.
    with pytest.raises(ValueError, match="preprocessing patches 'square' there, 'native' now"):
        prepare(config.replace(patches="native"))


def test_native_rows_embed_each_image_whole_at_its_own_aspect_ratio(ray_session, export, tmp_path):
    """--patches native: every image whole on its own grid of up to --max-patches patches; the rows are
    the model's embeddings of those patches in process, and the output's identity says native."""
    from pipeline.data.decode import preprocess_batch
    from pipeline.data.writing import write_shards

    sizes = [(96, 32), (32, 80), (64, 64), (40, 50), (120, 30)]

    def samples():
        for i, (w, h) in enumerate(sizes * 2):
            pixels = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
            yield f"{i:04d}", {"jpg": encode(pixels, "png"), "cls": b"1"}  # PNG bytes: exact pixels

    urls = write_shards(samples(), tmp_path / "wide", prefix="wide", samples_per_shard=5)
    out = tmp_path / "out"
    config = EmbedConfig(
        data=str(tmp_path / "wide"), weights=export[0], out=str(out), batch_size=4, patches="native",
        max_patches=20,
    )  # fmt: skip
    plan = prepare(config)
    assert (plan.data_config.patches, plan.data_config.max_patches) == ("native", 20)
    summary = run(plan)
    assert (summary.committed, summary.rows) == (2, 10)
    rows = read_rows(out)
    images = images_by_key(sorted(urls))
    batch = {
        "key": np.array(list(images), dtype=object),
        "url": np.array(["u"] * len(images), dtype=object),
        "image": np.array(list(images.values()), dtype=object),
        "label": np.ones(len(images), np.int64),
        "error": np.array([""] * len(images), dtype=object),
    }
    native = preprocess_batch(batch, config=plan.data_config, train=False, epoch=0)
    grids = {tuple(g) for g in native["grid"].tolist()}  # one per aspect ratio, within the budget
    assert len(grids) == 5 and all(gh * gw <= 20 for gh, gw in grids) and (2, 7) in grids  # 96 x 32
    _, model = export
    with torch.no_grad():
        direct = model.embed(
            torch.from_numpy(native["patches"]), coords=torch.from_numpy(native["coords"]),
            mask=torch.from_numpy(native["mask"]), grid=torch.from_numpy(native["grid"]),
        ).numpy()  # fmt: skip
    order = [list(images).index(k) for k in rows["key"]]
    np.testing.assert_allclose(rows["embedding"], direct[order], rtol=1e-5, atol=1e-5)
    assert manifest(out)["preprocessing"]["patches"] == "native"
    # The checkpoint probe's executor (`run_in_process`): the same native rows, bit for bit, in one process.
    # The caller's own torch threads, which the Embedder's (its CPUs, fewer) must not outlive.
    threads = torch.get_num_threads()
    torch.set_num_threads(7)
    try:
        alone = read_rows(run_in_process(prepare(config.replace(out=str(tmp_path / "alone")))).out)
        assert torch.get_num_threads() == 7
    finally:
        torch.set_num_threads(threads)
    assert list(alone["key"]) == list(rows["key"])
    np.testing.assert_array_equal(alone["embedding"], rows["embedding"])


def test_shards_read_through_signed_urls_are_embedded_once_under_their_names(
    ray_session, synthetic_shards, export, tmp_path
):
    """Shards read through signed URLs (the store refuses any other, and an expired signature): no output
    holds the signature (rows, file names, footers, records, manifest), and the same command run again
    once the URLs are signed anew embeds nothing twice."""
    store = SignedStore(Path(synthetic_shards.dir)).start()
    try:
        names = [Path(url).name for url in synthetic_shards.urls[:2]]
        out = tmp_path / "out"

        def embed_signed():
            data = ",".join(store.url(name) for name in names)
            return run(prepare(EmbedConfig(data=data, weights=export[0], out=str(out), batch_size=8)))

        first = embed_signed()
        store.resign()  # the first URLs expire
        again = embed_signed()
    finally:
        store.stop()
    assert (first.committed, first.rows) == (2, 24)
    assert (again.committed, again.already_done, again.rows_in_output) == (0, 2, 24)
    shards = [f"{store.base}/data/{name}" for name in names]
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(output_name(url) for url in shards)
    rows = pq.read_table(out)
    assert sorted(set(rows["url"].to_pylist())) == shards and len(set(rows["key"].to_pylist())) == 24
    assert sorted(manifest(out)["shards"]) == shards
    assert not [p for p in out.rglob("*") if p.is_file() and b"sig=" in p.read_bytes()]


def test_an_interrupted_run_resumes_to_exactly_one_row_per_key(
    ray_session, synthetic_shards, export, tmp_path
):
    out = tmp_path / "out"
    config = EmbedConfig(data=synthetic_shards.dir, weights=export[0], out=str(out), batch_size=8)

    class Killed(Exception):
        pass

    def die_after_first(url, record):
        raise Killed(url)

    with pytest.raises(Killed):
        run(prepare(config), on_commit=die_after_first)
    # The manifest is written when a run starts and ends; the shard's record holds its commit.
    assert len(manifest(out)["shards"]) == 0 and len(list((out / RECORDS).iterdir())) == 1
    # What a crash at other moments leaves: a half-written temporary (an hour old: no run's commit in
    # flight), and a shard committed whose record was never written (here with garbage in it).
    half = out / f".{output_name(synthetic_shards.urls[2])}.tmp-0123456789ab"
    half.write_bytes(b"PAR1 half a file")
    os.utime(half, (time.time() - 7200, time.time() - 7200))
    (out / output_name(synthetic_shards.urls[3])).write_bytes(b"not what the manifest lists")
    plan = prepare(config)
    assert len(plan.work.done) == 1 and len(plan.work.pending) == 3
    summary = run(plan)
    assert (summary.committed, summary.already_done) == (3, 1)
    rows = read_rows(out)
    assert sorted(rows["key"]) == synthetic_shards.keys and len(rows["key"]) == 48
    assert not [p.name for p in out.iterdir() if storage.is_temporary(p.name)]
    assert len(manifest(out)["shards"]) == 4


@pytest.fixture(scope="module")
def corrupt_shard(tmp_path_factory):
    """One shard: 6 good JPEGs and one without a label, with a truncated JPEG and a zero-byte image
    between them."""
    members = []
    for i in range(6):
        pixels, label = render(i, image_size=48, num_classes=4)
        members += [(f"good{i}.cls", str(label).encode()), (f"good{i}.jpg", encode(pixels))]
        if i == 2:
            members += [("bad-empty.cls", b"1"), ("bad-empty.jpg", b"")]
        if i == 3:  # an image without its label member: a row with a null label, not a bad sample
            members += [("nolabel.jpg", encode(render(9, image_size=48, num_classes=4)[0]))]
        if i == 4:
            big = np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(big).save(buf, format="JPEG", quality=95)
            members += [("bad-cut.cls", b"1"), ("bad-cut.jpg", buf.getvalue()[: len(buf.getvalue()) // 2])]
    path = tmp_path_factory.mktemp("corrupt") / "mixed-000000.tar"
    path.write_bytes(tar_bytes(members))
    empty = path.parent / "mixed-000001.tar"  # a valid tar holding no sample at all
    empty.write_bytes(tar_bytes([]))
    return str(path), str(empty)


def test_bad_samples_are_listed_in_the_manifest_and_absent_from_rows(
    ray_session, corrupt_shard, export, tmp_path
):
    mixed, empty = corrupt_shard
    config = EmbedConfig(
        data=f"{mixed},{empty}", weights=export[0], out=str(tmp_path), batch_size=4, max_bad_fraction=0.5
    )
    summary = run(prepare(config.replace(max_lost_shards=1)))
    rows = read_rows(tmp_path)
    labels = dict(zip(rows["key"], rows["label"], strict=True))
    assert sorted(labels) == [f"good{i}" for i in range(6)] + ["nolabel"]
    assert labels["nolabel"] is None
    assert [labels[f"good{i}"] for i in range(6)] == [
        render(i, image_size=48, num_classes=4)[1] for i in range(6)
    ]
    assert str(pq.read_table(tmp_path / output_name(mixed)).schema.field("label").type) == "int64"
    assert manifest(tmp_path)["shards"][empty]["rows"] == 0  # committed too: an empty file, same schema
    assert pq.read_table(tmp_path / output_name(empty)).schema == pq.read_table(tmp_path).schema
    skipped = manifest(tmp_path)["shards"][mixed]["skipped"]
    assert {s["key"]: reason_category(s["reason"]) for s in skipped} == {
        "bad-empty": "empty image",
        "bad-cut": "truncated image",
    }
    assert [reason_category(s["reason"]) for s in manifest(tmp_path)["shards"][empty]["skipped"]] == [
        "lost shard"
    ]
    assert manifest(tmp_path)["lost_shards"] == {empty: "lost shard: the tar holds no samples"}
    # Counted in its own figure, not as a bad sample.
    assert summary.bad_samples["by_reason"] == {"empty image": 1, "truncated image": 1}
    assert summary.bad_samples["lost_shards"] == {empty: "the tar holds no samples"}
    assert "bad samples skipped: 2 (1 empty image, 1 truncated image)" in summary.format()
    assert "lost shards (no readable sample): 1" in summary.format()
    # None allowed by default: the job fails in one line naming the shard.
    refused = config.replace(out=str(tmp_path / "refused"))
    with pytest.raises(
        BadSampleBudgetError, match=r"^1 shard\(s\) gave no readable sample \(max_lost_shards 0\)"
    ):
        run(prepare(refused))


def test_an_unreadable_shard_is_not_committed_and_the_next_run_retries_it(
    ray_session, synthetic_shards, export, tmp_path, capsys
):
    shards = tmp_path / "shards"
    shards.mkdir()
    for url in synthetic_shards.urls[:2]:
        (shards / Path(url).name).write_bytes(Path(url).read_bytes())
    # The configuration as `jobs/embed.py ... --label-key none` makes it: the labels the shards hold
    # are not read, and every row's label is null.
    args = [
        "--data",
        str(shards),
        "--weights",
        export[0],
        "--out",
        str(tmp_path / "out"),
        "--batch-size",
        "8",
    ]
    assert embed_job.main([*args, "--cpu", "--label-key", "none", "--print-config"]) == 0
    config = EmbedConfig(**json.loads(capsys.readouterr().out))
    assert config.label_key is None
    plan = prepare(config)
    gone = shards / Path(synthetic_shards.urls[1]).name
    saved = gone.read_bytes()
    gone.unlink()  # vanishes between planning and reading, as a flaky store would make it
    summary = run(plan)
    assert summary.committed == 1 and list(summary.failed) == [str(gone)]
    assert reason_category(summary.failed[str(gone)]) == "unreadable shard"
    assert str(gone) not in manifest(tmp_path / "out")["shards"]
    gone.write_bytes(saved)
    again = run(prepare(config))
    assert (again.committed, again.already_done, again.failed, again.rows_in_output) == (1, 1, {}, 24)
    labels = read_rows(tmp_path / "out")["label"]
    assert len(labels) == 24 and all(label is None for label in labels)
    assert manifest(tmp_path / "out")["preprocessing"]["label_key"] is None


def test_s3_output_works_like_local(ray_session, first_run, synthetic_shards, export, monkeypatch, capsys):
    import boto3
    import pandas as pd
    import s3fs
    from moto import server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # Credentials and endpoint from the environment, as on a real cluster.
        for name, value in [
            ("AWS_ENDPOINT_URL", endpoint),
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
        ]:
            monkeypatch.setenv(name, value)
        boto3.client("s3").create_bucket(Bucket="emb")
        s3fs.S3FileSystem.clear_instance_cache()  # instances made before these variables were set
        config = first_run[0].replace(out="s3://emb/run1", overwrite=False)
        summary = run(prepare(config))
        assert (summary.committed, summary.rows) == (4, 48)
        fs = s3fs.S3FileSystem()
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("emb/run1"))
        files = sorted(output_name(u) for u in synthetic_shards.urls)
        assert names == [CLAIM, MANIFEST, RECORDS, *files]
        records = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"emb/run1/{RECORDS}"))
        assert records == [f"{f}.json" for f in files]
        remote = pd.read_parquet("s3://emb/run1").sort_values("key")
        local = pd.read_parquet(first_run[0].out).sort_values("key")
        assert list(remote["key"]) == list(local["key"])
        np.testing.assert_array_equal(np.stack(remote["embedding"]), np.stack(local["embedding"]))
        assert run(prepare(config)).already_done == 4

        # The same output through the command line, its endpoint in --storage-options alone: the
        # environment's now leads nowhere. With every shard done, the job needs no Ray.
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        s3fs.S3FileSystem.clear_instance_cache()
        capsys.readouterr()
        options = json.dumps({"client_kwargs": {"endpoint_url": endpoint}})
        args = ["--data", config.data, "--weights", config.weights, "--out", config.out, "--batch-size", "8"]
        assert embed_job.main([*args, "--cpu", "--storage-options", options]) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert "4 already done" in printed and "rows written: 0 (48 in the output)" in printed
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
