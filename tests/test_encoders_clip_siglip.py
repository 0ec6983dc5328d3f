"""CLIP text (last hidden, pooled, projection, every layer) and SigLIP vision (last hidden, pooled
attention head, every layer) against transformers, through ``load_pretrained`` from
``save_pretrained`` folders and from the hub naming (``text_model.`` / ``vision_model.`` prefixes,
full ``CLIPModel`` / ``SiglipModel`` files), plus preprocessing, bf16 storage and compile counts."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.refutil import assert_parity, perturb  # noqa: E402
from vidax.compat import load_pretrained  # noqa: E402
from vidax.core.jit import CompileCounter  # noqa: E402
from vidax.text import clip_text, siglip  # noqa: E402
from vidax.weights import CheckpointMismatchError, save_safetensors  # noqa: E402

V, T, EOS = 99, 11, 98
CLIP_KW = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=16, projection_dim=24, eos_token_id=EOS, hidden_act="quick_gelu")
SIGLIP_KW = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, image_size=28,
                 patch_size=7)


def _ids(eos=EOS):
    """B=2: row 0 has 7 tokens then padding (eos at 6), row 1 is full with an extra eos earlier
    (the first eos is pooled) and its largest id not at the eos."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, V - 2, (2, T)).astype(np.int64)
    ids[0, 6], ids[0, 7:] = eos, 0
    ids[1, 3], ids[1, 10] = eos, eos
    mask = (np.arange(T)[None] < np.array([[7], [T]])).astype(np.int64)
    return ids, mask


def _check_all(out, ref, what):
    for k in ref.keys():
        if k == "hidden_states":
            assert len(out[k]) == len(ref[k])
            for i, (a, b) in enumerate(zip(out[k], ref[k])):
                assert_parity(a, b.numpy(), what=f"{what} hidden_states[{i}]")
        elif ref[k] is not None:
            assert_parity(out[k], ref[k].numpy(), what=f"{what} {k}")


@pytest.fixture(scope="module")
def clip_models():
    torch.manual_seed(0)
    cfg = transformers.CLIPTextConfig(**CLIP_KW)
    return {cls.__name__: perturb(cls(cfg), seed=2) for cls in
            (transformers.CLIPTextModel, transformers.CLIPTextModelWithProjection)}


@pytest.mark.parametrize("cls", ["CLIPTextModel", "CLIPTextModelWithProjection"])
def test_clip_text_parity(cls, clip_models, tmp_path):
    model = clip_models[cls]
    model.save_pretrained(tmp_path)
    cm = load_pretrained(tmp_path)
    ids, mask = _ids()
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), output_hidden_states=True)
    out = cm(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out["hidden_states"]) == CLIP_KW["num_hidden_layers"] + 1
    _check_all(out, ref, cls)
    first = ref.text_embeds if cls.endswith("Projection") else ref.last_hidden_state
    assert_parity(cm.forward(input_ids=ids, attention_mask=mask), first.numpy(), what=f"{cls} forward")
    if cls == "CLIPTextModel":  # pooled = final-normed state at the first eos
        np.testing.assert_array_equal(out.pooler_output, out.last_hidden_state[[0, 1], [6, 3]])
        # no mask (causal only), as HunyuanVideo calls it
        with torch.no_grad():
            ref = model(input_ids=torch.from_numpy(ids))
        assert_parity(cm(input_ids=ids).pooler_output, ref.pooler_output.numpy(), what="unmasked pooled")


def test_clip_text_hub_naming_and_legacy_eos(clip_models, tmp_path):
    """A hub ``CLIPTextModel`` (``text_model.*`` names, position_ids buffer saved) whose config
    still has the legacy ``eos_token_id = 2`` (pooled at the largest id), and a full ``CLIPModel``."""
    model = clip_models["CLIPTextModel"]
    sd = {"text_model." + k: v.numpy() for k, v in model.state_dict().items()}
    sd["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
    save_safetensors(sd, tmp_path / "model.safetensors")
    cfg = dict(model.config.to_dict(), eos_token_id=2, architectures=["CLIPTextModel"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    legacy = transformers.CLIPTextModel(transformers.CLIPTextConfig(**dict(CLIP_KW, eos_token_id=2)))
    legacy.load_state_dict(model.state_dict())
    ids, mask = _ids()
    ids[1, 5] = V - 1  # the largest id, not an eos
    with torch.no_grad():
        ref = legacy.eval()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    cm = load_pretrained(tmp_path)
    _check_all(cm(input_ids=ids, attention_mask=mask), ref, "legacy-eos hub naming")
    # the text half of a full CLIPModel (vision half, logit_scale ignored) through load_clip_text
    full = transformers.CLIPModel(transformers.CLIPConfig(text_config=CLIP_KW, projection_dim=24, vision_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=28, patch_size=14)))
    full = perturb(full, seed=5)
    full.save_pretrained(tmp_path / "full")
    enc = clip_text.load_clip_text(tmp_path / "full")
    assert enc.cfg.projection_dim == 24
    with torch.no_grad():
        want = full.get_text_features(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    want = getattr(want, "pooler_output", want)
    assert_parity(np.asarray(enc(ids, mask)["text_embeds"]), want.numpy(), what="CLIPModel text features")
    # a diffusers pipeline folder: text_encoder_2/ is found
    (tmp_path / "pipe" / "text_encoder_2").mkdir(parents=True)
    model.save_pretrained(tmp_path / "pipe" / "text_encoder_2")
    assert clip_text.load_clip_text(tmp_path / "pipe").cfg.projection_dim is None
    # a missing tensor is named
    del sd["text_model.encoder.layers.1.mlp.fc2.bias"]
    save_safetensors(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"layers\.1\.mlp\.fc2\.bias"):
        load_pretrained(tmp_path)


@pytest.fixture(scope="module")
def siglip_model():
    torch.manual_seed(0)
    return perturb(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SIGLIP_KW)), seed=3)


def _pixels(b=2, seed=0):
    return np.random.default_rng(seed).standard_normal((b, 3, 28, 28)).astype(np.float32)


def test_siglip_vision_parity(siglip_model, tmp_path):
    siglip_model.save_pretrained(tmp_path)
    cm = load_pretrained(tmp_path)
    px = _pixels()
    with torch.no_grad():
        ref = siglip_model(pixel_values=torch.from_numpy(px), output_hidden_states=True)
    out = cm(pixel_values=px, output_hidden_states=True)
    assert len(out.hidden_states) == SIGLIP_KW["num_hidden_layers"] + 1
    _check_all(out, ref, "SiglipVisionModel")
    assert_parity(cm.forward(pixel_values=px), ref.last_hidden_state.numpy(), what="siglip forward")
    with pytest.raises(ValueError, match="image size"):
        cm.forward(pixel_values=np.zeros((1, 3, 14, 14), np.float32))


def test_siglip_hub_naming_full_model_and_no_head(siglip_model, tmp_path):
    # a full SiglipModel file (vision_model.* + text_model.* + logit_scale / logit_bias)
    full = transformers.SiglipModel(transformers.SiglipConfig(
        vision_config=SIGLIP_KW, text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=40,
                                                  num_hidden_layers=1, num_attention_heads=4)))
    full = perturb(full, seed=4)
    full.save_pretrained(tmp_path / "full")
    enc = siglip.load_siglip(tmp_path / "full")
    px = _pixels(seed=1)
    with torch.no_grad():
        ref = full.vision_model(pixel_values=torch.from_numpy(px))
    out = enc(px)
    assert_parity(np.asarray(out["last_hidden_state"]), ref.last_hidden_state.numpy(), what="SiglipModel vision last")
    assert_parity(np.asarray(out["pooler_output"]), ref.pooler_output.numpy(), what="SiglipModel vision pooled")
    # without the pooling head
    torch.manual_seed(1)
    nohead = perturb(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SIGLIP_KW, vision_use_head=False)))
    sd = {"vision_model." + k: v.numpy() for k, v in nohead.state_dict().items()}
    (tmp_path / "nohead").mkdir()
    save_safetensors(sd, tmp_path / "nohead" / "model.safetensors")
    (tmp_path / "nohead" / "config.json").write_text(json.dumps(dict(nohead.config.to_dict(),
                                                                     architectures=["SiglipVisionModel"])))
    cm = load_pretrained(tmp_path / "nohead")
    with torch.no_grad():
        ref = nohead(pixel_values=torch.from_numpy(px))
    res = cm(pixel_values=px)
    assert res.pooler_output is None and ref.pooler_output is None
    assert_parity(res.last_hidden_state, ref.last_hidden_state.numpy(), what="no-head last")


def test_siglip_preprocess_matches_image_processor():
    pytest.importorskip("PIL")
    proc = transformers.SiglipImageProcessor(size={"height": 28, "width": 28})
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (40, 53, 3), dtype=np.uint8), rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)]
    ref = proc(images=imgs, return_tensors="np")["pixel_values"]
    out = siglip.preprocess(imgs, size=28)
    assert out.shape == ref.shape == (2, 3, 28, 28)
    np.testing.assert_allclose(out, ref, atol=2e-2)  # PIL vs torchvision resampling: within a level or so
    np.testing.assert_allclose(out[1], ref[1], atol=1e-6)  # no resize: exact


def test_bf16_storage_and_compile_once(siglip_model, clip_models, tmp_path):
    siglip_model.save_pretrained(tmp_path / "s")
    enc = siglip.load_siglip(tmp_path / "s", dtype=ml_dtypes.bfloat16)
    assert enc.state["blocks"]["q"]["kernel"].dtype == ml_dtypes.bfloat16
    px = _pixels()
    out = np.asarray(enc(px)["last_hidden_state"])
    assert out.dtype == np.float32
    ref_model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SIGLIP_KW))
    ref_model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in siglip_model.state_dict().items()})
    with torch.no_grad():
        ref = ref_model.eval()(pixel_values=torch.from_numpy(px)).last_hidden_state.numpy()
    assert_parity(out, ref, what="siglip bf16 storage")
    other = siglip.init(enc.cfg, seed=1, dtype=ml_dtypes.bfloat16)
    with CompileCounter() as cc:
        enc(px[::-1].copy())
        other(px)
    assert cc.count == 0
    cfg = clip_text.CLIPTextConfig.from_hf(clip_models["CLIPTextModel"].config.to_dict())
    e1 = clip_text.init(cfg, seed=0)
    ids, mask = _ids()
    e1(ids, mask)
    e2 = clip_text.init(cfg, seed=1)
    with CompileCounter() as cc:
        e1((ids + 1) % V, mask)
        e2(ids, mask[::-1].copy())
    assert cc.count == 0
