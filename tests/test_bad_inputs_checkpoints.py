"""A damaged checkpoint folder is refused at validation, headers only, before anything is written.

Each case: a complete tiny Wan folder (``save_pretrained``, tests/conftest.py ``tiny_wan_folder``)
with one file damaged; ``vidax generate`` exits 2 with one line naming the checkpoint, the file
(and the tensor), no traceback, and the store (holding a finished run) stays byte-identical."""
import json
import os
import shutil
import struct

import numpy as np
import pytest

from stages.request import Request, RequestError, validate
from tests.test_bad_inputs_options import refused

PROMPT = "a red panda in a canoe"


def _args(folder):
    return ["--model", "wan2.1-t2v-1.3b", "--checkpoint", str(folder), "--prompt", PROMPT, "--height", "32",
            "--width", "32", "--frames", "5", "--steps", "1"]


@pytest.fixture
def wan(tiny_wan_folder, tmp_path):
    d = tmp_path / "Wan-copy"
    shutil.copytree(tiny_wan_folder, d)
    return d


def _one(folder, sub):
    (f,) = sorted((folder / sub).glob("*.safetensors"))
    return f


def test_intact_folder_validates_without_reading_weights(wan, monkeypatch):
    """The positive control: the check reads headers only (no tensor data is read)."""
    from vidax.weights import io

    def no_data(*a, **k):
        raise AssertionError("validation read tensor data")

    monkeypatch.setattr(io, "_safetensors_read", no_data)
    monkeypatch.setattr(io, "_read_member", no_data)
    r = validate(Request(model="wan2.1-t2v-1.3b", checkpoint=str(wan), prompt=PROMPT, height=32, width=32,
                         num_frames=5, steps=1))
    assert r.checkpoint == str(wan)


def test_truncated_transformer_safetensors(wan, store, capsys):
    f = _one(wan, "transformer")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    refused(store, capsys, _args(wan), "checkpoint", "DiT", str(f), "not a readable safetensors file")


def test_header_length_2_to_the_62(wan, store, capsys):
    f = _one(wan, "transformer")
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    refused(store, capsys, _args(wan), "checkpoint", "DiT", str(f), "header too large")


def test_one_tensor_of_the_wrong_shape(wan, store, capsys):
    from safetensors.numpy import load_file, save_file

    f = _one(wan, "transformer")
    tensors = load_file(str(f))
    name = "blocks.1.attn1.to_q.weight"
    assert tensors[name].shape == (24, 24)
    tensors[name] = np.zeros((24, 20), tensors[name].dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})
    refused(store, capsys, _args(wan), "checkpoint", "DiT", name, "[24, 20]", "expected [24, 24]", f.name)


def test_truncated_text_encoder(wan, store, capsys):
    f = _one(wan, "text_encoder")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    refused(store, capsys, _args(wan), "checkpoint", "text encoder", str(f))


def test_missing_vae_weights(wan, store, capsys):
    f = _one(wan, "vae")
    f.unlink()
    refused(store, capsys, _args(wan), "checkpoint", "vae")


@pytest.fixture
def original_layout(tiny_wan_folder, tmp_path):
    """The same tiny model laid out as the original Wan2.1 release, with a T5 ``.pth`` whose pickle
    would run ``os.system`` (touching a marker file) if it were unpickled by ``torch.load``."""
    import torch

    from vidax.models.wan import dit as wdit
    from vidax.models.wan import vae as wvae
    from vidax.weights import open_checkpoint, save_safetensors

    d = tmp_path / "Wan-original"
    d.mkdir()
    src = tiny_wan_folder
    dcfg = wdit.WanDiTConfig.from_diffusers(json.loads((src / "transformer" / "config.json").read_text()))
    sd = open_checkpoint(src / "transformer").numpy()
    ren = wdit.diffusers_keymap(dcfg).rename(sd, wdit.original_keymap(dcfg))
    save_safetensors({ren[k]: v for k, v in sd.items()}, d / "diffusion_pytorch_model.safetensors")
    (d / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "model_type": "t2v", "dim": 24, "ffn_dim": 48, "freq_dim": 32, "in_dim": 16,
        "out_dim": 16, "num_heads": 2, "num_layers": 2, "text_dim": 32, "text_len": 512, "eps": 1e-6}))
    vcfg = wvae.WanVAEConfig.from_diffusers(json.loads((src / "vae" / "config.json").read_text()))
    vsd = open_checkpoint(src / "vae").numpy()
    vren = wvae.diffusers_keymap(vcfg).rename(vsd, wvae.original_keymap(vcfg))
    torch.save({vren[k]: torch.from_numpy(np.ascontiguousarray(v)) for k, v in vsd.items()}, d / "Wan2.1_VAE.pth")
    shutil.copytree(src / "tokenizer", d / "google" / "umt5-xxl")
    marker = tmp_path / "owned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"shared.weight": torch.ones(2), "x": Evil()}, d / "models_t5_umt5-xxl-enc-bf16.pth")
    return d, marker


def test_original_layout_t5_pickle_calling_os_system(original_layout, store, capsys):
    folder, marker = original_layout
    pth = folder / "models_t5_umt5-xxl-enc-bf16.pth"
    refused(store, capsys, _args(folder), "checkpoint", "text encoder", str(pth), "refusing to load",
            "system")
    assert not marker.exists()


def test_python_api_names_the_field(wan):
    f = _one(wan, "vae")
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(RequestError) as e:
        validate(Request(model="wan2.1-t2v-1.3b", checkpoint=str(wan), prompt=PROMPT, height=32, width=32,
                         num_frames=5, steps=1))
    assert e.value.field == "checkpoint" and str(f) in str(e.value)


# ------------------------------------------------------------------ the same check, other families' key maps
@pytest.fixture(scope="module")
def cosmos_folders(tmp_path_factory):
    from tests import cosmos_fixtures as cf

    root = tmp_path_factory.mktemp("cosmos-ckpt")
    cf.cosmos3_folder(root / "cosmos3")
    cf.predict25_folder(root / "predict25")
    return root


COSMOS = {"cosmos3": "cosmos3-nano", "predict25": "cosmos2.5-2b"}


def _cosmos_args(folder, name):
    return ["--model", COSMOS[name], "--checkpoint", str(folder), "--prompt", "a red kite over the sea", "--height",
            "32", "--width", "32", "--frames", "5", "--steps", "1"]


@pytest.fixture
def cosmos(cosmos_folders, tmp_path):
    def copy(name):
        d = tmp_path / name
        shutil.copytree(cosmos_folders / name, d)
        return d
    return copy


@pytest.mark.parametrize("name", sorted(COSMOS))
def test_cosmos_intact_folders_validate(cosmos, name):
    d = cosmos(name)
    validate(Request(model=COSMOS[name], checkpoint=str(d), prompt="a red kite over the sea", height=32, width=32,
                     num_frames=5, steps=1))


def test_cosmos3_transformer_tensor_of_the_wrong_shape(cosmos, store, capsys):
    from safetensors.numpy import load_file, save_file

    d = cosmos("cosmos3")
    f = _one(d, "transformer")
    tensors = load_file(str(f))
    name = next(k for k in sorted(tensors) if tensors[k].ndim == 2 and k.endswith("weight"))
    a = tensors[name]
    tensors[name] = np.zeros((a.shape[0] + 1, a.shape[1]), a.dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})
    refused(store, capsys, _cosmos_args(d, "cosmos3"), "checkpoint", "transformer", name, f.name)


@pytest.mark.parametrize("sub,what", [("vae", "VAE"), ("text_encoder", "text encoder")])
def test_cosmos25_truncated_component(cosmos, store, capsys, sub, what):
    d = cosmos("predict25")
    f = _one(d, sub)
    f.write_bytes(f.read_bytes()[:-64])
    refused(store, capsys, _cosmos_args(d, "predict25"), "checkpoint", what, str(f))


# ------------------------------------------------------------------ each family's loaders, headers only
def _headers_only(pipe, request):
    """What each of ``pipe.weight_loaders`` does under ``headers_only``: ``checked`` (stopped before
    any tensor data, the key map's shapes fitting), ``missing`` (no such file), or ``read`` (it
    returned: it loaded something)."""
    from vidax.weights import HeadersChecked, headers_only

    out = {}
    for what, load in pipe.weight_loaders(request):
        try:
            with headers_only():
                load()
            out[what] = "read"
        except HeadersChecked:
            out[what] = "checked"
        except FileNotFoundError:
            out[what] = "missing"
    return out


def test_cogvideox_ltx_ltx2_loaders_check_headers_only(tmp_path):
    """Folders of the parity tests (every component but the text encoder, saved by diffusers'
    ``save_pretrained``): each family's DiT / VAE / audio / connector loaders stop at the headers
    with the key maps' shapes fitting; the text encoder is reported missing."""
    from types import SimpleNamespace

    import torch
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, AutoencoderKLLTXVideo,
                           LTX2VideoTransformer3DModel, LTXVideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from tests import test_ltx2_pipeline as T2
    from tests import test_ltx_pipeline as T1
    from tests.test_cogvideox_pipeline import _ref_pipeline
    from vidax.models.cogvideox.pipeline import CogVideoX
    from vidax.models.ltx.ltx2 import LTX2
    from vidax.models.ltx.ltxv import LTXVideo

    req = SimpleNamespace(image=None, options={})
    _ref_pipeline("2b-ddim", tmp_path / "cog")
    assert _headers_only(CogVideoX(str(tmp_path / "cog")), req) == {
        "text encoder": "missing", "DiT": "checked", "VAE": "checked"}

    torch.manual_seed(0)
    d = tmp_path / "ltx"
    LTXVideoTransformer3DModel(**T1.DIT).save_pretrained(d / "transformer")
    AutoencoderKLLTXVideo(**T1.VAE).save_pretrained(d / "vae")
    (d / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline"}))
    assert _headers_only(LTXVideo(str(d)), req) == {"text encoder": "missing", "DiT": "checked", "VAE": "checked"}

    d = tmp_path / "ltx2"
    for name, mod in dict(transformer=LTX2VideoTransformer3DModel(**T2.DIT), connectors=LTX2TextConnectors(**T2.CONN),
                          vae=AutoencoderKLLTX2Video(**T2.VAE), audio_vae=AutoencoderKLLTX2Audio(**T2.AVAE),
                          vocoder=LTX2Vocoder(**T2.VOC)).items():
        mod.save_pretrained(d / name)
    (d / "model_index.json").write_text(json.dumps({"_class_name": "LTX2Pipeline"}))
    assert _headers_only(LTX2(str(d)), req) == {
        "text encoder": "missing", "text connectors": "checked", "DiT": "checked", "VAE": "checked",
        "audio VAE": "checked", "vocoder": "checked"}


# ------------------------------------------------------------------ HunyuanVideo (T2V: Llama; I2V: a LLaVA)
@pytest.fixture(scope="module")
def hunyuan_folders(tmp_path_factory):
    from tests import lora_folders

    root = tmp_path_factory.mktemp("hunyuan-ckpt")
    args = {"t2v": lora_folders.hunyuanvideo(root / "t2v"), "i2v": lora_folders.hunyuanvideo_i2v(root / "i2v")}
    return root, args


@pytest.fixture
def hunyuan(hunyuan_folders, tmp_path, cond_image):
    """``name -> (a copy of that folder, its generate arguments)``."""
    root, args = hunyuan_folders

    def copy(name):
        d = tmp_path / name
        shutil.copytree(root / name, d)
        extra = ["--image", cond_image] if name == "i2v" else []
        return d, ["--checkpoint", str(d), *args[name], "--steps", "1", *extra]
    return copy


def test_hunyuanvideo_loaders_check_headers_only(hunyuan, monkeypatch, store, capsys):
    """Every HunyuanVideo weight load stops at the headers with the key maps' shapes fitting, the
    image-to-video LLaVA's three parts (language model, vision tower, projector) each on its own;
    intact folders validate without reading any tensor data."""
    from types import SimpleNamespace

    from stages import cli
    from tests.test_bad_inputs import tree_digest
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoI2V, HunyuanVideoT2V
    from vidax.weights import io

    req = SimpleNamespace(image=None, options={})
    (t2v, a2), (i2v, a1) = hunyuan("t2v"), hunyuan("i2v")
    assert _headers_only(HunyuanVideoT2V(str(t2v)), req) == {
        "text encoder": "checked", "CLIP text encoder (text_encoder_2)": "checked", "DiT": "checked", "VAE": "checked"}
    assert _headers_only(HunyuanVideoI2V(str(i2v)), req) == {
        "text encoder (LLaVA language model)": "checked", "text encoder (LLaVA vision tower)": "checked",
        "text encoder (LLaVA projector)": "checked", "CLIP text encoder (text_encoder_2)": "checked", "DiT": "checked",
        "VAE": "checked"}

    def no_data(*a, **k):
        raise AssertionError("validation read tensor data")

    monkeypatch.setattr(io, "_safetensors_read", no_data)
    for args in (a2, a1):  # the positive control: the CLI's validation passes (stopped by a bad store id)
        before = tree_digest(store)
        assert cli.main(["generate", *args, "--store", str(store), "--run-id", "../x"]) == 2
        err = capsys.readouterr().err
        assert "run_id" in err and "checkpoint" not in err, err
        assert tree_digest(store) == before


def _reshape_tensor(f, name):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(f))
    a = tensors[name]
    tensors[name] = np.zeros((a.shape[0] + 1,) + a.shape[1:], a.dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})


@pytest.mark.parametrize("name,what", [
    ("multi_modal_projector.linear_2.weight", "text encoder (LLaVA projector)"),
    ("vision_tower.encoder.layers.1.mlp.fc1.weight", "text encoder (LLaVA vision tower)"),
    ("language_model.model.layers.0.mlp.up_proj.weight", "text encoder (LLaVA language model)"),
], ids=["projector", "vision-tower", "language-model"])
def test_hunyuanvideo_i2v_llava_tensor_of_the_wrong_shape(hunyuan, store, capsys, name, what):
    d, args = hunyuan("i2v")
    f = _one(d, "text_encoder")
    _reshape_tensor(f, name)
    short = name.split(".", 1)[1] if what.endswith("(LLaVA projector)") else name.rsplit("layers.", 1)[-1]
    refused(store, capsys, args, "checkpoint", what, short, "mis-shaped", f.name)


@pytest.mark.parametrize("sub,what", [("transformer", "DiT"), ("text_encoder_2", "CLIP text encoder"),
                                      ("text_encoder", "text encoder")])
def test_hunyuanvideo_t2v_truncated_component(hunyuan, store, capsys, sub, what):
    d, args = hunyuan("t2v")
    f = _one(d, sub)
    f.write_bytes(f.read_bytes()[:-64])
    refused(store, capsys, args, "checkpoint", what, str(f))


def test_hunyuanvideo_dit_tensor_of_the_wrong_shape(hunyuan, store, capsys):
    d, args = hunyuan("t2v")
    f = _one(d, "transformer")
    _reshape_tensor(f, "single_transformer_blocks.1.proj_mlp.weight")
    refused(store, capsys, args, "checkpoint", "DiT", "single_transformer_blocks.1.proj_mlp.weight", f.name)


def test_remote_checkpoint_checked_after_its_fetch_before_any_write(wan, store, capsys, gcs_emulator, monkeypatch,
                                                                     tmp_path):
    """A ``gs://`` checkpoint: validation reads its configs alone; its headers are checked once the
    weights are fetched, before ``request.json`` or any stage is written."""
    import time

    from vidax.weights import source as S

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "cache"))
    f = _one(wan, "transformer")
    f.write_bytes(f.read_bytes()[:-1000])
    url = f"gs://vidax-test/models/damaged-{time.time_ns()}"
    fs, root = S.filesystem(url)
    for p in sorted(x for x in wan.rglob("*") if x.is_file()):
        fs.put_file(str(p), f"{root}/{p.relative_to(wan).as_posix()}")
    from stages import cli
    from tests.test_bad_inputs import tree_digest

    before = tree_digest(store)
    rc = cli.main(["generate", *_args(url), "--store", str(store)])
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err, err
    assert f"vidax: fetching {url}" in err  # (the fetch's progress lines come first)
    last = err.strip().splitlines()[-1]
    assert last.startswith("vidax: error: checkpoint: DiT: ") and "diffusion_pytorch_model.safetensors" in last, last
    assert "not a readable safetensors file" in last
    assert tree_digest(store) == before, "the store changed"


def test_remote_checkpoint_in_distributed_mode_checked_by_the_stage_before_it_writes(wan, store, capsys, gcs_emulator,
                                                                                   monkeypatch, tmp_path):
    """Distributed mode: the parent validates the request from a ``gs://`` checkpoint's configs
    alone and writes ``request.json`` (it never fetches weights: the stages' machines do); the
    stage fetches the checkpoint and checks its headers before it takes its lease or touches its
    record: ``vidax stage`` (what a stage's machine runs; the Prefect stage task runs the same
    ``run_stage``) exits 2 in one line naming the file, and the store is byte-identical."""
    import time

    from stages import cli
    from stages.store import RunStore
    from tests.test_bad_inputs import tree_digest
    from vidax.weights import source as S

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "parent-cache"))
    f = _one(wan, "transformer")
    f.write_bytes(f.read_bytes()[:-1000])
    url = f"gs://vidax-test/models/damaged-dist-{time.time_ns()}"
    fs, root = S.filesystem(url)
    for p in sorted(x for x in wan.rglob("*") if x.is_file()):
        fs.put_file(str(p), f"{root}/{p.relative_to(wan).as_posix()}")
    req = validate(Request(model="wan2.1-t2v-1.3b", checkpoint=url, prompt=PROMPT, height=32, width=32, num_frames=5,
                           steps=1))  # the parent: configs only
    assert not list((tmp_path / "parent-cache").rglob("*.safetensors")), "the parent fetched weights"
    RunStore(str(store)).run("dist").write_json("request.json", req.to_json())
    capsys.readouterr()
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "stage-cache"))  # the stage's own machine
    for stage in ("encode", "sample"):
        before = tree_digest(store)
        rc = cli.main(["stage", "dist", stage, "--store", str(store)])
        out, err = capsys.readouterr()
        assert rc == 2 and "Traceback" not in err + out, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("vidax: error: checkpoint: DiT: ") and "diffusion_pytorch_model.safetensors" in last, last
        assert "not a readable safetensors file" in last
        assert tree_digest(store) == before, "the store changed"
