"""`jobs/export.py`: a vitray export in, what timm and transformers load out, with a model card; every
misfit refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import vit
from pipeline.data.config import DataConfig
from pipeline.model_source import load_model_source
from tests.job_scripts import load_job
from tests.test_model_source import run_dir  # noqa: F401  (a fixture: a run written by the training code)

TINY = "vit_tiny_test"  # embed_dim 64, depth 2, 4 heads, mlp 128, patch 8, image 32
export_job = load_job("export")  # the job script itself, run in this process
TOL = {"rtol": 1e-4, "atol": 1e-4}


def write_run(root, patches: str = "square", **overrides) -> vit.VisionTransformer:
    """A run directory whose final/ is written by the project's own export writer, with the training
    summary the training loop records; returns the model (random values everywhere, no zero head)."""
    model = vit.create_model(TINY, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), **overrides)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    data = DataConfig(
        image_size=32, patch_size=8, crop_fraction=0.9, eval_interpolation="bilinear", patches=patches
    )
    training = {
        "step": 40,
        "max_steps": 40,
        "finished": True,
        "loss": 1.2345,
        "accuracy": 0.5,
        "eval_accuracy": 0.4375,
        "config": {
            "task": {"objective": "supervised"},
            "run": {"shards": "s3://bucket/train-{000000..000003}.tar", "eval_shards": ""},
            "optim": {"optimizer": "adamw", "lr": 0.001, "batch_size": 8, "max_steps": 40},
        },
    }
    extra = {"objective": "supervised", "preprocessing": data.to_dict(), "training": training}
    vit.save_pretrained(root / "final", model.state_dict(), model.config, extra=extra)
    return model.eval()


def run_job(capsys, *argv: str) -> tuple[int, str, str]:
    code = export_job.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_timm_export_of_a_run_loads_in_timm_with_its_preprocessing_and_card(tmp_path, capsys):
    import timm
    from timm.data import resolve_data_config

    model = write_run(tmp_path / "run", head="finetune")
    out = tmp_path / "timm"
    code, printed, err = run_job(capsys, "--weights", tmp_path / "run", "--to", "timm", "--out", out)
    assert code == 0, err
    assert sorted(os.listdir(out)) == [".vitray-export", "README.md", "config.json", "model.safetensors"]
    assert f'timm.create_model("local-dir:{out}", pretrained=True)' in printed
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), **TOL)
    data = resolve_data_config({}, model=loaded)
    assert tuple(data["mean"]) == model.config.mean and data["crop_pct"] == 0.9
    assert data["interpolation"] == "bilinear"  # the run's evaluation preprocessing
    card = (out / "README.md").read_text()
    for fact in (
        "library_name: timm",
        "s3://bucket/train-{000000..000003}.tar",
        "40 of 40",
        "1.2345",
        "0.4375",
    ):
        assert fact in card, fact
    vitray = load_model_source(str(tmp_path / "run"))
    assert vitray.sha256 in card
    # --weights takes the timm folder back: the same weights, normalization and all.
    back = load_model_source(str(out))
    assert (back.kind, back.sha256, back.config.num_heads) == ("timm", vitray.sha256, 4)
    # A rerun replaces its own files.
    assert run_job(capsys, "--weights", tmp_path / "run", "--to", "timm", "--out", out)[0] == 0


def test_hf_export_loads_in_transformers_and_imports_back(tmp_path, capsys):
    from transformers import ViTModel

    model = write_run(tmp_path / "run", num_classes=0)  # a pretraining head without a classifier
    out = tmp_path / "hf"
    code, _, err = run_job(capsys, "--weights", tmp_path / "run" / "final", "--to", "hf", "--out", out)
    assert code == 0, err
    assert sorted(os.listdir(out)) == [
        ".vitray-export",
        "README.md",
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
    ]
    hf = ViTModel.from_pretrained(out, attn_implementation="eager").eval()
    x = images()
    with torch.no_grad():
        result = hf(pixel_values=x)
        torch.testing.assert_close(result.last_hidden_state[:, 0], model.embed(x), **TOL)
        torch.testing.assert_close(result.pooler_output, model.embed(x, pre_logits=True), **TOL)
    assert json.loads((out / "preprocessor_config.json").read_text())["image_std"] == list(model.config.std)
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and "`model(pixel_values=x).last_hidden_state[:, 0]`" in card
    # --weights takes the transformers folder back: the same weights, with the normalization that
    # preprocessor_config.json records.
    back = load_model_source(str(out))
    assert back.kind == "hf" and back.config.norm_eps == model.config.norm_eps
    assert back.sha256 == load_model_source(str(tmp_path / "run")).sha256


def test_a_pooled_model_exports_to_timm_and_comes_back_pooled(tmp_path, capsys):
    import timm

    model = write_run(tmp_path / "run", head="finetune", pool="gap")
    assert run_job(capsys, "--weights", tmp_path / "run", "--to", "timm", "--out", tmp_path / "timm")[0] == 0
    loaded = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images()), model(images()), **TOL)
    back = load_model_source(str(tmp_path / "timm"))
    assert back.config.pool == "gap" and back.sha256 == load_model_source(str(tmp_path / "run")).sha256
    code, _, err = run_job(capsys, "--weights", tmp_path / "run", "--to", "hf", "--out", tmp_path / "hf")
    assert code == 2 and "pool gap" in err


def test_an_encoder_only_export_drops_the_head_and_says_so(tmp_path, capsys):
    model = write_run(tmp_path / "run")  # pretraining head + classifier: no counterpart in either library
    for target in ("timm", "hf"):
        out = tmp_path / target
        code, _, err = run_job(capsys, "--weights", tmp_path / "run", "--to", target, "--out", out)
        assert code == 2 and "pass --encoder-only" in err and err.count("\n") == 1, err
        assert not out.exists()  # refused before anything was written
        code, printed, err = run_job(
            capsys, "--weights", tmp_path / "run", "--to", target, "--out", out, "--encoder-only"
        )
        assert code == 0, err
        assert "none (exported with --encoder-only)" in (out / "README.md").read_text()
    assert "add_pooling_layer=False" in printed  # the hf ViTModel without a pooler
    assert model.config.head == "pretrain"


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    write_run(tmp_path / "run", head="finetune")
    torch.save({"w": torch.zeros(1)}, tmp_path / "model.pth")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "config.json").write_text("{}")
    (tmp_path / "hfdir" / "model.safetensors").write_bytes(b"")
    run = tmp_path / "run"
    cases = [
        (["--weights", tmp_path / "nope", "--to", "timm"], "does not exist"),
        (
            ["--weights", tmp_path / "model.pth", "--to", "timm"],
            "is a weights file; export takes what vitray wrote",
        ),
        (["--weights", tmp_path / "hfdir", "--to", "hf"], "holds no vitray export .*; pass a vitray run"),
        (
            ["--weights", run, "--to", "timm", "--out", tmp_path / "busy"],
            "holds files this export did not write",
        ),
        (["--weights", run, "--to", "hf", "--out", run / "final", "--overwrite"], "is where the weights are"),
    ]
    for argv, message in cases:
        if "--out" not in argv:
            argv += ["--out", tmp_path / "out"]
        code, _, err = run_job(capsys, *argv)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert re.search(message, err), (message, err)
    assert sorted(os.listdir(tmp_path / "busy")) == ["notes.txt"]
    assert sorted(os.listdir(run / "final")) == ["config.json", "weights.safetensors"]
    # An export for one library in another's folder.
    assert run_job(capsys, "--weights", run, "--to", "hf", "--out", tmp_path / "hf")[0] == 0
    code, _, err = run_job(capsys, "--weights", run, "--to", "timm", "--out", tmp_path / "hf")
    assert code == 2 and "holds a vitray export for transformers (--to hf), not one for timm" in err
    with pytest.raises(SystemExit):  # argparse: --to must be a target
        export_job.main(["--weights", str(run), "--to", "onnx", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("target", ["timm", "hf"])
def test_a_model_trained_on_native_aspect_patches_exports_only_for_square_images_when_asked(
    tmp_path, capsys, target
):
    """Neither library's ViT takes native-aspect batches as vitray computes them: refused in one line that
    says why and what to pass; with --square the same weights, for square images, and the card says so."""
    model = write_run(tmp_path / "run", patches="native", head="finetune")
    out = tmp_path / target
    code, _, err = run_job(capsys, "--weights", tmp_path / "run", "--to", target, "--out", out)
    why = (
        "timm's NaFlexViT takes such batches but resamples" if target == "timm" else "transformers has no ViT"
    )
    assert code == 2 and why in err and "pass --square to export them for square 32 px images" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    code, _, err = run_job(capsys, "--weights", tmp_path / "run", "--to", target, "--out", out, "--square")
    assert code == 0, err
    card = (out / "README.md").read_text()
    assert "images at their own aspect ratio, up to 16 patches each" in card and "(--square)" in card
    if target == "timm":
        import timm

        loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(images()), model(images()), **TOL)


def test_an_export_for_one_library_never_replaces_another_s_and_replaces_its_own(tmp_path, capsys):
    """A transformers export writes every file name a timm one does: the folder's marker tells them apart."""
    write_run(tmp_path / "run", head="finetune")
    run, timm_dir, hf_dir = tmp_path / "run", tmp_path / "timm", tmp_path / "hf"
    for target, out in (("timm", timm_dir), ("hf", hf_dir)):
        assert run_job(capsys, "--weights", run, "--to", target, "--out", out)[0] == 0
    before = {p.name: p.read_bytes() for p in timm_dir.iterdir()}
    for target, out, other in (("hf", timm_dir, "timm"), ("timm", hf_dir, "transformers")):
        code, _, err = run_job(capsys, "--weights", run, "--to", target, "--out", out)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--out {out} holds a vitray export for {other}" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in timm_dir.iterdir()} == before  # left as it was
    assert run_job(capsys, "--weights", run, "--to", "timm", "--out", timm_dir)[0] == 0  # its own: replaced
    # An export from before the marker (its files alone) is no proof of which library's it is.
    (timm_dir / ".vitray-export").unlink()
    code, _, err = run_job(capsys, "--weights", run, "--to", "hf", "--out", timm_dir)
    assert code == 2 and "holds files this export did not write" in err
    assert run_job(capsys, "--weights", run, "--to", "hf", "--out", timm_dir, "--overwrite")[0] == 0


def test_an_export_to_s3_arrives_whole_through_failing_requests(tmp_path):
    """--out on a loopback S3 failing every 4th request: every file there, transformers loads the copy."""
    import boto3
    import s3fs
    from transformers import ViTForImageClassification

    from pipeline.export import ExportConfig, export
    from tests.flaky_s3 import FlakyS3

    model = write_run(tmp_path / "run", head="finetune")
    s3 = FlakyS3(period=4, max_faults=10).start()
    try:
        boto3.client(
            "s3", endpoint_url=s3.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket="exports")  # fmt: skip
        s3.faulty()
        config = ExportConfig(
            weights=str(tmp_path / "run"), to="hf", out="s3://exports/ft", storage_options=s3.storage_options
        )
        result = export(config)
        s3.faulty(False)
        assert sum(s3.faults.values()) > 0
        host, port = s3.upstream  # past the faults
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True, key="testing", secret="testing",
            client_kwargs={"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
        )  # fmt: skip
        fs.get("exports/ft/", str(tmp_path / "copy"), recursive=True)
    finally:
        s3.stop()
    assert sorted(os.listdir(tmp_path / "copy")) == sorted([*result.files, ".vitray-export"])
    hf = ViTForImageClassification.from_pretrained(tmp_path / "copy", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=images()).logits, model(images()), **TOL)


def test_a_checkpoint_exports_with_its_step_and_run_in_the_card(run_dir, tmp_path, capsys):  # noqa: F811
    import timm

    from pipeline import dcp

    checkpoint = run_dir / dcp.checkpoint_name(1)
    out = tmp_path / "timm"
    code, _, err = run_job(capsys, "--weights", checkpoint, "--to", "timm", "--out", out, "--encoder-only")
    assert code == 0, err
    source = load_model_source(str(checkpoint))
    model = vit.create_model(source.config)
    model.load_state_dict(source.state_dict)
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images()), model.eval().embed(images()), **TOL)
    card = (out / "README.md").read_text()
    assert "| steps | 1 of 100 |" in card and "| objective | supervised |" in card
    assert f"checkpoint {checkpoint}" in card
