"""`--weights` for the embedding job: every source loads the same weights, and every misfit fails in one line."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import vit
from pipeline import dcp
from pipeline.data.config import DataConfig
from pipeline.model_source import (
    inference_model,
    load_model_source,
    pack_state_dict,
    state_dict_sha256,
    unpack_state_dict,
)
from pipeline.train.checkpointing import checkpoint
from tests.configs import tiny_config

TINY = "vit_tiny_test"  # embed_dim 64, depth 2, mlp_dim 128, patch 8, 4 heads, image 32
TRAIN = tiny_config(model=TINY)


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """No zero or constant tensor left (zero-init heads would hide a wrong mapping)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run's directory written by the training code itself, in one process: a complete
    checkpoint (step 1), an unfinished one (step 2), and final/ exported from the same model."""
    from pipeline.train.step.model import build_model, init_distributed, model_config
    from pipeline.train.step.train_step import TrainStep

    root = tmp_path_factory.mktemp("run")
    created = not dist.is_initialized()
    _, _, device = init_distributed()
    try:
        model = build_model(TRAIN, device)
        step = TrainStep(model, TRAIN, device)
        mcfg = model_config(TRAIN)
        data = DataConfig(image_size=32, patch_size=8, crop_fraction=0.75, eval_interpolation="bilinear")
        saved = {"train": TRAIN.to_dict(), "model_config": mcfg.to_dict(), "data": data.to_dict()}
        checkpoint.save(root / dcp.checkpoint_name(1), model, step.optimizer, {"step": 1}, saved)
        (root / dcp.checkpoint_name(2)).mkdir()  # a save that never finished
        checkpoint.export_final(root / "final", model, mcfg, {"preprocessing": data.to_dict()})
    finally:
        if created:
            dist.destroy_process_group()
    return root


def test_run_dir_final_and_checkpoint_give_the_same_weights(run_dir, tmp_path):
    final = load_model_source(str(run_dir / "final"))
    assert (final.kind, final.path) == ("export", str(run_dir / "final"))
    as_run = load_model_source(str(run_dir))
    assert (as_run.kind, as_run.path, as_run.sha256) == ("export", str(run_dir / "final"), final.sha256)
    ckpt = load_model_source(str(run_dir / dcp.checkpoint_name(1)))
    assert ckpt.kind == "checkpoint" and ckpt.config == final.config
    assert ckpt.sha256 == final.sha256  # the same tensors, whichever format they came in
    for k, v in final.state_dict.items():
        assert torch.equal(v, ckpt.state_dict[k]), k
    assert ckpt.preprocessing["crop_fraction"] == final.preprocessing["crop_fraction"] == 0.75

    # A run without final/: its latest complete checkpoint (step 2 never finished).
    (tmp_path / "run").mkdir()
    for step in (1, 2):
        os.symlink(run_dir / dcp.checkpoint_name(step), tmp_path / "run" / dcp.checkpoint_name(step))
    latest = load_model_source(str(tmp_path / "run"))
    assert latest.kind == "checkpoint" and latest.path.endswith(dcp.checkpoint_name(1))
    assert latest.sha256 == final.sha256


def test_a_saved_preprocessing_that_does_not_read_is_one_line_naming_the_file_and_the_field(
    run_dir, tmp_path
):
    """An export's or a checkpoint's training preprocessing with a field unknown here (a newer vitray, an
    edit) would otherwise be dropped for the default crop: other embeddings, with no word."""
    export, ckpt = tmp_path / "final", tmp_path / dcp.checkpoint_name(1)
    shutil.copytree(run_dir / "final", export)
    shutil.copytree(run_dir / dcp.checkpoint_name(1), ckpt)
    for where, key in ((export, "preprocessing"), (ckpt, "data")):
        meta = json.loads((where / "config.json").read_text())
        meta[key]["crop_mode"] = "letterbox"
        (where / "config.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError) as caught:
            load_model_source(str(where))
        message = str(caught.value)
        assert f"{where / 'config.json'}: its preprocessing does not read" in message, message
        assert "crop_mode" in message and "\n" not in message
    # An export made outside training describes the model's input there: that is no training record.
    model = vit.create_model("vit_tiny_test")
    vit.save_pretrained(tmp_path / "plain", model.state_dict(), model.config)
    assert load_model_source(str(tmp_path / "plain")).preprocessing is None


def test_a_checkpoint_whose_saved_settings_do_not_read_is_not_resumed(run_dir, tmp_path):
    saved = json.loads((run_dir / dcp.checkpoint_name(1) / "config.json").read_text())
    config = vit.ViTConfig.from_dict(saved["model_config"])
    for section, change in (("train", {"version": 99}), ("data", {"crop_mode": "letterbox"})):
        (tmp_path / section).mkdir()
        path = tmp_path / section / "config.json"
        path.write_text(json.dumps({**saved, section: {**saved[section], **change}}))
        with pytest.raises(dcp.CheckpointRefusedError) as caught:
            checkpoint.check_compatible(tmp_path / section, config)
        assert str(caught.value).startswith(f"{path}: its {section} settings do not read: "), caught.value
        assert ("version 99" if section == "train" else "crop_mode") in str(caught.value)
    (tmp_path / "same").mkdir()
    (tmp_path / "same" / "config.json").write_text(json.dumps(saved))
    checkpoint.check_compatible(tmp_path / "same", config)  # as saved: resumes


def test_weights_on_s3_load_with_the_jobs_storage_options_alone(run_dir, monkeypatch):
    """A run directory, its final/ and a checkpoint on a loopback S3, the endpoint and keys in the
    Location's options only: each loads, the same weights as from local disk."""
    import boto3
    from moto import server as moto_server

    from pipeline.storage import Location

    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
        client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s",
                              endpoint_url=options["client_kwargs"]["endpoint_url"])  # fmt: skip
        client.create_bucket(Bucket="weights")
        for file in (p for p in run_dir.rglob("*") if p.is_file()):
            client.upload_file(str(file), "weights", f"run/{file.relative_to(run_dir)}")
        local = load_model_source(str(run_dir))
        run = Location("s3://weights/run", options)
        for where, kind in [(run, "export"), (run.join(dcp.checkpoint_name(1)), "checkpoint")]:
            source = load_model_source(where)
            assert (source.kind, source.sha256) == (kind, local.sha256), where
    finally:
        server.stop()


def test_another_image_size_resamples_the_position_embeddings(run_dir):
    source = load_model_source(str(run_dir), image_size=48)
    assert (source.config.image_size, source.config.num_patches) == (48, 36)
    assert source.sha256 == load_model_source(str(run_dir)).sha256  # the weights as stored
    model = inference_model(source.config, source.state_dict, "cpu")
    patches = torch.randint(0, 256, (2, 36, 192), dtype=torch.uint8)
    with torch.no_grad():
        assert model.embed(patches).shape == (2, 64)
    with pytest.raises(ValueError, match="image_size 50 is not divisible by patch_size 8"):
        load_model_source(str(run_dir), image_size=50)


def test_the_named_model_must_fit_the_weights(run_dir):
    for where in (run_dir, run_dir / dcp.checkpoint_name(1)):
        with pytest.raises(ValueError) as info:
            load_model_source(str(where), model="vit_s16")
        message = str(info.value)
        assert "embed_dim 64" in message and "not vit_s16 (embed_dim 384" in message
        assert "pass --model vit_tiny_test" in message and "\n" not in message
    assert load_model_source(str(run_dir), model=TINY).config.name == TINY
    with pytest.raises(ValueError, match="unknown model 'vit_nope'"):
        load_model_source(str(run_dir), model="vit_nope")


class _Exploit:
    """Unpickling it runs ``touch <sentinel>``: the sentinel's absence proves nothing ran."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def dotted_name_pickle(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` (a dotted path) with one string: the
    STACK_GLOBAL opcode makes the unpickler walk ``name`` through ``module``'s own attributes."""

    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()  # SHORT_BINUNICODE

    # PROTO 4, module, name, STACK_GLOBAL, (argument,) TUPLE1, REDUCE, STOP
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(argument) + b"\x85R."


def timm_layout(sd: dict[str, torch.Tensor], config: vit.ViTConfig) -> dict[str, torch.Tensor]:
    """A vitray state dict as timm stores it (standing for a timm checkpoint; timm is not installed)."""
    p, c = config.patch_size, config.num_channels
    out = {}
    for k, v in sd.items():
        if k in ("patch_embed.mean", "patch_embed.std"):
            continue
        if k == "patch_embed.proj.weight":  # Linear over (p1, p2, c) -> Conv2d (D, C, P, P)
            v = v.reshape(v.shape[0], p, p, c).permute(0, 3, 1, 2)
        elif k in ("cls_token", "pos_embed"):
            v = v.reshape(1, -1, v.shape[-1])
        k = k.replace("head.pre_logits.", "pre_logits.fc.").replace("head.fc.", "head.")
        out[k] = v.contiguous()
    return out


def test_timm_file_loads_the_same_weights_and_pickles_are_refused(tmp_path):
    model = perturbed(vit.create_model(TINY, num_classes=4))
    sd = model.state_dict()
    torch.save({"model": timm_layout(sd, model.config)}, tmp_path / "timm.pth")
    source = load_model_source(str(tmp_path / "timm.pth"))  # keys tell it is timm
    assert source.kind == "timm"
    assert source.config.name == TINY and source.sha256 == state_dict_sha256(sd)
    assert load_model_source(str(tmp_path / "timm.pth"), weights_format="timm").sha256 == source.sha256

    sentinel = tmp_path / "pwned"
    torch.save({"model": _Exploit(sentinel)}, tmp_path / "evil.pth")  # unpickling it runs a command
    with pytest.raises(ValueError, match="holds more than tensors") as info:
        load_model_source(str(tmp_path / "evil.pth"), weights_format="timm")
    # The object it names, and not torch's own advice (to load it with weights_only=False).
    assert f"evil.pth holds more than tensors (it names {os.system.__module__}.system);" in str(info.value)
    assert "\n" not in str(info.value) and "weights_only" not in str(info.value)
    assert not sentinel.exists()


def test_transformers_directory_converts_and_embeds_like_transformers(tmp_path):
    import transformers

    hf_config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        attn_implementation="eager",
    )
    hf = perturbed(transformers.ViTModel(hf_config))
    hf.save_pretrained(tmp_path / "hf")
    source = load_model_source(str(tmp_path / "hf"))
    assert source.kind == "hf" and source.config.num_heads == 4 and source.config.norm_eps == 1e-12
    model = inference_model(source.config, unpack_state_dict(pack_state_dict(source.state_dict)), "cpu")
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(pixel_values=x)
        torch.testing.assert_close(model.embed(x), out.last_hidden_state[:, 0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.embed(x, pre_logits=True), out.pooler_output, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"embed_dim 64.*not vit_ti16"):
        load_model_source(str(tmp_path / "hf"), model="vit_ti16")


def test_weights_files_of_other_libraries_embed_as_their_own_model(synthetic_shards, tmp_path):
    """What jobs/embed.py resolves --weights to before any Ray work (`pipeline.embed.job.prepare`), for
    a torchvision .pth, a transformers .bin and a timm single-file .safetensors: the format told from
    the keys, and the model built from them embedding as the source library's model does."""
    import torch.nn.functional as F
    from safetensors.torch import save_file

    from pipeline.embed.config import EmbedConfig
    from pipeline.embed.job import prepare
    from tests.vit.test_convert import random_state_dict, torchvision_reference, torchvision_shapes

    def plan(weights: Path):
        config = EmbedConfig(
            data=synthetic_shards.dir, weights=str(weights), out=str(tmp_path / weights.stem)
        )
        built = prepare(config)
        model = inference_model(built.source.config, built.source.state_dict, "cpu")
        return built, model

    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    tv = random_state_dict(torchvision_shapes())
    torch.save(tv, tmp_path / "torchvision.pth")
    built, model = plan(tmp_path / "torchvision.pth")
    assert built.header["weights"]["source"] == "torchvision" and built.header["dim"] == 64
    assert built.source.config.name == TINY
    with torch.no_grad():  # the [CLS] embedding is what torchvision's classifier reads
        logits = F.linear(model.embed(x), tv["heads.head.weight"], tv["heads.head.bias"])
        torch.testing.assert_close(logits, torchvision_reference(tv, x), rtol=1e-4, atol=1e-4)

    import transformers

    hf_config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, attn_implementation="eager",
    )  # fmt: skip
    hf = perturbed(transformers.ViTModel(hf_config))
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    built, model = plan(tmp_path / "pytorch_model.bin")
    assert built.header["weights"]["source"] == "hf"
    with torch.no_grad():
        expected = hf(pixel_values=x).last_hidden_state[:, 0]
        torch.testing.assert_close(model.embed(x), expected, rtol=1e-4, atol=1e-4)

    vitray = perturbed(vit.create_model(TINY, num_classes=4))
    save_file(timm_layout(vitray.state_dict(), vitray.config), tmp_path / "model.safetensors")
    built, model = plan(tmp_path / "model.safetensors")
    assert built.header["weights"]["source"] == "timm"
    assert built.source.sha256 == state_dict_sha256(vitray.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model.embed(x), vitray.embed(x), rtol=1e-5, atol=1e-5)


def test_paths_that_hold_no_weights_fail_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    cases = [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "holds no vitray export"),
        (tmp_path / "notes.txt", "is a file but not"),
    ]
    for path, words in cases:
        with pytest.raises(ValueError, match=words) as info:
            load_model_source(str(path))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unknown --weights-format"):
        load_model_source(str(tmp_path), weights_format="onnx")


def crafted_checkpoint(run_dir, where) -> None:
    """A copy of the run's complete checkpoint at ``where``, whose ``.metadata`` the test replaces."""
    shutil.copytree(run_dir / dcp.checkpoint_name(1), where)


def test_checkpoint_metadata_is_unpickled_only_as_checkpoint_metadata(run_dir, tmp_path):
    sentinel = tmp_path / "pwned"
    bad = tmp_path / "checkpoint_00000001"
    crafted_checkpoint(run_dir, bad)
    (bad / ".metadata").write_bytes(pickle.dumps(_Exploit(sentinel)))
    with pytest.raises(ValueError, match=r"refers to posix\.system; refusing to unpickle it") as info:
        load_model_source(str(bad))
    assert "\n" not in str(info.value) and not sentinel.exists()
    assert json.loads((bad / "config.json").read_text())["model_config"]["name"] == TINY

    # A dotted name under a module that checkpoint metadata does use: that module imports os, so
    # resolving "os.system" through it would reach the shell.
    for module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        (bad / ".metadata").write_bytes(dotted_name_pickle(module, "os.system", f"touch {sentinel}"))
        with pytest.raises(ValueError, match=r"refers to .*os\.system; refusing to unpickle it") as info:
            load_model_source(str(bad))
        assert "\n" not in str(info.value) and not sentinel.exists()


def test_a_checkpoint_entry_that_is_not_a_tensor_is_refused_before_it_is_read(run_dir, tmp_path):
    """DCP reads a byte entry with torch.load(weights_only=False): a pickle that runs code."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    sentinel = tmp_path / "pwned"
    bad = tmp_path / "checkpoint_00000001"
    crafted_checkpoint(run_dir, bad)
    payload = io.BytesIO()
    torch.save(_Exploit(sentinel), payload)
    (bad / "evil.distcp").write_bytes(payload.getvalue())
    with open(bad / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file, written by DCP just above
    fqn = "model.pos_embed"
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("evil.distcp", 0, len(payload.getvalue()))
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError, match=r"model\.pos_embed is not a tensor .*refusing to read it") as info:
        load_model_source(str(bad))
    assert "\n" not in str(info.value) and not sentinel.exists()


def test_a_training_resume_reads_its_checkpoint_as_data_only(run_dir, tmp_path):
    """Resume goes through the same locks: ``.metadata`` through the restricted unpickler, and the
    optimizer's plain values (which DCP unpickles with weights_only=False) as plain data only."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from pipeline.train.step.model import build_model, init_distributed
    from pipeline.train.step.train_step import TrainStep

    sentinel = tmp_path / "pwned"
    bad = tmp_path / "checkpoint_00000001"
    crafted_checkpoint(run_dir, bad)
    exploits = [
        pickle.dumps(_Exploit(sentinel)),
        dotted_name_pickle("torch.distributed.checkpoint.metadata", "os.system", f"touch {sentinel}"),
    ]
    created = not dist.is_initialized()
    _, _, device = init_distributed()
    try:
        model = build_model(TRAIN, device)
        optimizer = TrainStep(model, TRAIN, device).optimizer
        assert checkpoint.load(run_dir / dcp.checkpoint_name(1), model, optimizer)["step"] == 1
        for exploit in exploits:
            (bad / ".metadata").write_bytes(exploit)
            with pytest.raises(dcp.CheckpointRefusedError, match="system; refusing to unpickle it") as info:
                checkpoint.load(bad, model, optimizer)
            assert "\n" not in str(info.value) and not sentinel.exists()

        shutil.copy(run_dir / dcp.checkpoint_name(1) / ".metadata", bad / ".metadata")
        with open(bad / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # the test's own file, written by the training code above
        lr = next(k for k, v in metadata.storage_data.items() if k.fqn.endswith(".lr"))
        assert isinstance(metadata.state_dict_metadata[lr.fqn], BytesStorageMetadata)
        payload = io.BytesIO()
        torch.save(_Exploit(sentinel), payload)
        (bad / "evil.distcp").write_bytes(payload.getvalue())
        metadata.storage_data[lr] = _StorageInfo("evil.distcp", 0, len(payload.getvalue()))
        with open(bad / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        with pytest.raises(dcp.CheckpointRefusedError, match=rf"{lr.fqn} is not plain data") as info:
            checkpoint.load(bad, model, optimizer)
        assert "\n" not in str(info.value) and not sentinel.exists()
    finally:
        if created:
            dist.destroy_process_group()


def test_packed_weights_are_shared_not_copied():
    sd = perturbed(vit.create_model(TINY)).state_dict()
    packed = pack_state_dict(sd)
    assert all(a.dtype.name == "float32" for a in packed.values())
    unpacked = unpack_state_dict(packed)
    assert all(unpacked[k].data_ptr() == packed[k].ctypes.data for k in packed)
    assert state_dict_sha256(unpacked) == state_dict_sha256(sd)
    changed = dict(sd, **{"norm.bias": sd["norm.bias"] + 1e-3})
    assert state_dict_sha256(changed) != state_dict_sha256(sd)


def test_a_remote_export_is_read_through_a_local_copy_and_named_by_its_url(run_dir, tmp_path):
    # vit reads local files only; pipeline.storage fetches a remote export's two files, and messages name
    # the URL, not the temporary copy.
    from pipeline import storage

    url = "memory://vitray-model-source/final"
    storage.upload_dir(run_dir / "final", url, commit_last=vit.weights.CONFIG_FILE)
    assert load_model_source(url).sha256 == load_model_source(str(run_dir)).sha256
    broken = tmp_path / "final"
    shutil.copytree(run_dir / "final", broken)
    (broken / vit.weights.CONFIG_FILE).write_text("{not json")
    storage.upload_dir(broken, "memory://vitray-model-source/broken")
    with pytest.raises(ValueError, match=r"config\.json in memory://vitray-model-source/broken is not JSON"):
        load_model_source("memory://vitray-model-source/broken", weights_format="vitray")
