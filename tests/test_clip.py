"""CLIP vision tower: parity against transformers (CLIPVisionModel / ...WithProjection), the original
Wan2.1 release naming (fused qkv), checkpoint mismatch errors, image preprocessing vs
CLIPImageProcessor."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")

from tests.refutil import assert_parity, perturb  # noqa: E402
from vidax.compat import load_pretrained  # noqa: E402
from vidax.core.jit import CompileCounter  # noqa: E402
from vidax.text import clip  # noqa: E402
from vidax.weights import CheckpointMismatchError, LazyTensor, open_checkpoint, save_safetensors  # noqa: E402
from vidax.weights.io import Checkpoint  # noqa: E402

TINY = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=128)


def _ref_model(act="quick_gelu", projection=False, layers=4, seed=0):
    cfg = transformers.CLIPVisionConfig(**dict(TINY, num_hidden_layers=layers), hidden_act=act, projection_dim=24)
    torch.manual_seed(seed)
    cls = transformers.CLIPVisionModelWithProjection if projection else transformers.CLIPVisionModel
    return perturb(cls(cfg), seed=seed)


def _pixels(B=3, seed=0, size=32):
    return np.random.default_rng(seed).standard_normal((B, 3, size, size)).astype(np.float32)


def _ref_out(model, x):
    with torch.no_grad():
        return model(pixel_values=torch.from_numpy(x), output_hidden_states=True)


# ------------------------------------------------------------------------------------------ config
def test_config_from_hf():
    c = clip.CLIPVisionConfig.from_hf(transformers.CLIPVisionConfig().to_dict())
    assert (c.image_size, c.patch_size, c.hidden_size, c.num_layers, c.num_heads, c.hidden_act) == (
        224, 32, 768, 12, 12, "quick_gelu")
    assert c.projection_dim is None and c.seq_len == 50
    w = clip.CLIPVisionConfig.from_hf(dict(transformers.CLIPVisionConfig(projection_dim=7).to_dict(),
                                           architectures=["CLIPVisionModelWithProjection"]))
    assert w.projection_dim == 7
    # a full CLIPConfig: its vision_config, projection_dim from the top level
    full = transformers.CLIPConfig(vision_config=dict(TINY, hidden_act="gelu"), projection_dim=16).to_dict()
    f = clip.CLIPVisionConfig.from_hf(dict(full, architectures=["CLIPModel"]))
    assert (f.hidden_size, f.num_layers, f.hidden_act, f.projection_dim) == (64, 4, "gelu", 16)
    assert clip.WAN_VIT_H_14.seq_len == 257 and clip.WAN_VIT_H_14.head_dim == 80
    with pytest.raises(ValueError):
        clip.CLIPVisionConfig(hidden_size=64, num_heads=5)
    with pytest.raises(ValueError):
        clip.CLIPVisionConfig(hidden_act="nope")
    hash(c)  # static jit argument


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_parity_vs_transformers(act, tmp_path):
    model = _ref_model(act)
    model.save_pretrained(tmp_path)
    cm = load_pretrained(tmp_path)
    assert isinstance(cm.model_config, clip.CLIPVisionConfig) and cm.model_config.hidden_act == act
    x = _pixels()
    ref = _ref_out(model, x)
    hs = ref.hidden_states
    assert len(hs) == 5
    out = cm.forward(pixel_values=x, output_hidden_states=True)
    assert out.dtype == np.float32
    assert_parity(out, ref.last_hidden_state.numpy(), what=f"{act} forward")
    full = cm.outputs(pixel_values=x, output_hidden_states=True)
    assert_parity(full["last_hidden_state"], ref.last_hidden_state.numpy(), what=f"{act} last_hidden_state")
    assert_parity(full["pooler_output"], ref.pooler_output.numpy(), what=f"{act} pooler_output")
    assert_parity(full["penultimate"], hs[-2].numpy(), what=f"{act} hidden_states[-2]")
    assert len(full["hidden_states"]) == len(hs)
    for i, (a, b) in enumerate(zip(full["hidden_states"], hs)):
        assert_parity(a, b.numpy(), what=f"{act} hidden_states[{i}]")
    pen = cm.penultimate(x)
    assert_parity(pen, hs[-2].numpy(), what=f"{act} penultimate()")
    # without output_hidden_states the dict has the same values
    small = cm.outputs(pixel_values=x)
    assert "hidden_states" not in small
    np.testing.assert_allclose(small["penultimate"], pen, atol=1e-5, rtol=1e-5)


def test_parity_with_projection_and_prefixed_names(tmp_path):
    """CLIPVisionModelWithProjection (``vision_model.`` prefix + visual_projection); also a
    CLIPVisionModel folder in the hub's (transformers 4) naming: prefix and a saved position_ids."""
    model = _ref_model("gelu", projection=True, seed=1)
    model.save_pretrained(tmp_path / "proj")
    cm = load_pretrained(tmp_path / "proj")
    assert cm.model_config.projection_dim == 24
    x = _pixels(2, seed=1)
    ref = _ref_out(model, x)
    with torch.no_grad():
        first = model(pixel_values=torch.from_numpy(x), return_dict=False)[0].numpy()
    out = cm.forward(pixel_values=x)
    assert out.shape == (2, 24)
    assert_parity(out, first, what="with projection: forward = image_embeds")
    full = cm.outputs(pixel_values=x)
    assert_parity(full["image_embeds"], ref.image_embeds.numpy(), what="image_embeds")
    assert_parity(full["penultimate"], ref.hidden_states[-2].numpy(), what="with projection: hidden_states[-2]")

    # hub-style CLIPVisionModel folder: vision_model.* names, position_ids buffer, extra projection
    sd = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    assert all(k.startswith("vision_model.") for k in sd if k != "visual_projection.weight")
    sd["vision_model.embeddings.position_ids"] = np.arange(17, dtype=np.int64)[None]
    (tmp_path / "hub").mkdir()
    save_safetensors(sd, tmp_path / "hub" / "model.safetensors")
    cfg = dict(model.config.to_dict(), architectures=["CLIPVisionModel"])
    (tmp_path / "hub" / "config.json").write_text(json.dumps(cfg))
    hub = load_pretrained(tmp_path / "hub")
    assert hub.model_config.projection_dim is None
    assert_parity(hub.forward(pixel_values=x), ref.last_hidden_state.numpy(), what="hub naming: last_hidden_state")
    assert_parity(hub.penultimate(x), ref.hidden_states[-2].numpy(), what="hub naming: hidden_states[-2]")
    # and a diffusers pipeline folder (image_encoder/) through load_clip
    (tmp_path / "pipe").mkdir()
    (tmp_path / "hub").rename(tmp_path / "pipe" / "image_encoder")
    enc = clip.load_clip(tmp_path / "pipe")
    assert_parity(enc.penultimate(x), ref.hidden_states[-2].numpy(), what="load_clip(pipeline folder)")


def test_init_penultimate_and_jit_reuse():
    cfg = clip.CLIPVisionConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=48, num_layers=3,
                                num_heads=4, hidden_act="gelu", projection_dim=8)
    enc = clip.init(cfg, seed=0)
    params = nnx.to_pure_dict(enc.state)
    shapes = clip.param_shapes(cfg)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shapes)):
        assert a.shape == s.shape and a.dtype == np.float32
        assert np.all(a != 0) and not np.all(a == 1)
    x = _pixels(2, size=16)
    out = enc(x, output_hidden_states=True)
    assert out["last_hidden_state"].shape == (2, 17, 32) and out["image_embeds"].shape == (2, 8)
    assert out["hidden_states"].shape == (4, 2, 17, 32)
    pen = enc.penultimate(x)
    np.testing.assert_allclose(pen, out["penultimate"], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(out["hidden_states"][-2], out["penultimate"])
    np.testing.assert_array_equal(out["hidden_states"][-1], out["last_hidden_state"])
    enc2 = clip.init(dataclasses.replace(cfg), seed=0)
    with CompileCounter() as cc:
        enc2.penultimate(x + 1)
    assert cc.count == 0, "same shapes + equal config must hit the jit cache"
    with pytest.raises(ValueError, match="doesn't match model"):
        enc.penultimate(_pixels(1, size=20))


def test_parameters_carry_logical_axes():
    """Every parameter names its axes (the sharding rules' input); the stack leads with ``layers``."""
    cfg = clip.CLIPVisionConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=48, num_layers=3,
                                num_heads=4, projection_dim=8)
    enc = clip.abstract(cfg)
    params = {jax.tree_util.keystr(p): v for p, v in
              jax.tree_util.tree_leaves_with_path(enc.state, is_leaf=lambda x: isinstance(x, nnx.Variable))}
    axes = {k: v.get_metadata()["out_sharding"] for k, v in params.items()}
    for k, v in params.items():
        assert len(axes[k]) == len(v.shape), k
    assert axes["['blocks']['q']['kernel']"] == ("layers", "embed", "heads")
    assert axes["['blocks']['q']['bias']"] == ("layers", "heads")
    assert axes["['blocks']['o']['kernel']"] == ("layers", "heads", "embed")
    assert axes["['blocks']['fc1']['kernel']"] == ("layers", "embed", "ffn")
    assert axes["['blocks']['fc2']['kernel']"] == ("layers", "ffn", "embed")
    assert axes["['blocks']['norm1']['scale']"] == ("layers", "embed")
    assert axes["['patch']['kernel']"] == (None, None, None, "embed")


# ------------------------------------------------------------------------------------------ Wan naming
class _WanStyleViT(torch.nn.Module):
    """Independent torch model with the module tree and forward semantics of the original release's
    vision tower (Wan2.1 ``wan/modules/clip.py`` ``VisionTransformer``: pre-norm, 'token' pooling,
    exact GELU, fused qkv read as ``view(b, s, 3, heads, head_dim)``), a second reference for the
    Wan naming."""

    class _Attn(torch.nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.to_qkv = torch.nn.Linear(d, 3 * d)
            self.proj = torch.nn.Linear(d, d)

        def forward(self, x):
            b, s, c = x.shape
            q, k, v = self.to_qkv(x).view(b, s, 3, self.h, c // self.h).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return self.proj(o.transpose(1, 2).reshape(b, s, c))

    class _Block(torch.nn.Module):
        def __init__(self, d, f, h):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(d, eps=1e-5)
            self.attn = _WanStyleViT._Attn(d, h)
            self.norm2 = torch.nn.LayerNorm(d, eps=1e-5)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(d, f), torch.nn.GELU(), torch.nn.Linear(f, d),
                                           torch.nn.Dropout(0.0))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    def __init__(self, image=32, patch=8, d=64, f=128, h=4, layers=3, out=24):
        super().__init__()
        n = (image // patch) ** 2
        self.patch_embedding = torch.nn.Conv2d(3, d, patch, patch, bias=False)
        self.cls_embedding = torch.nn.Parameter(torch.randn(1, 1, d) * d**-0.5)
        self.pos_embedding = torch.nn.Parameter(torch.randn(1, n + 1, d) * d**-0.5)
        self.pre_norm = torch.nn.LayerNorm(d, eps=1e-5)
        self.transformer = torch.nn.Sequential(*[self._Block(d, f, h) for _ in range(layers)])
        self.post_norm = torch.nn.LayerNorm(d, eps=1e-5)
        self.head = torch.nn.Parameter(torch.randn(d, out) * d**-0.5)

    def forward(self, x, use_31_block=False):
        x = self.patch_embedding(x).flatten(2).permute(0, 2, 1)
        x = torch.cat([self.cls_embedding.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        x = self.pre_norm(x)
        return self.transformer[:-1](x) if use_31_block else self.transformer(x)


class _WanStyleCLIP(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.visual = _WanStyleViT(**kw)
        self.textual = torch.nn.ModuleDict({"token_embedding": torch.nn.Embedding(10, 8)})
        self.log_scale = torch.nn.Parameter(torch.tensor(2.6592))


WAN_TINY = clip.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_layers=3,
                                 num_heads=4, hidden_act="gelu", projection_dim=24)


def test_wan_expected_names_match_wan_module_tree():
    ref = _WanStyleCLIP()
    sd = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k.startswith("visual.")}
    assert sd == clip.wan_expected_shapes(WAN_TINY)
    h14 = clip.wan_expected_shapes(clip.WAN_VIT_H_14)
    assert h14["visual.transformer.31.attn.to_qkv.weight"] == (3840, 1280)
    assert h14["visual.pos_embedding"] == (1, 257, 1280) and h14["visual.head"] == (1280, 1024)
    assert len(h14) == 7 + 32 * 12 + 1


def test_wan_pth_vs_wan_style_reference(tmp_path):
    torch.manual_seed(0)
    ref = perturb(_WanStyleCLIP(), seed=3)
    path = tmp_path / "models_clip_tiny.pth"
    torch.save(ref.state_dict(), path)
    x = _pixels(2, seed=2)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        want_pen = ref.visual(xt, use_31_block=True).numpy()
        last = ref.visual(xt)
        want_last = last.numpy()
        want_pool = ref.visual.post_norm(last[:, 0])
        want_emb = (want_pool @ ref.visual.head).numpy()
    for enc in (clip.load_clip(path, WAN_TINY), clip.load_clip(path, num_heads=4)):
        assert enc.cfg == WAN_TINY
        assert_parity(enc.penultimate(x), want_pen, what="wan .pth: use_31_block")
        out = enc(x)
        assert_parity(out["penultimate"], want_pen, what="wan .pth: penultimate")
        assert_parity(out["last_hidden_state"], want_last, what="wan .pth: last")
        assert_parity(out["pooler_output"], want_pool.numpy(), what="wan .pth: pooled")
        assert_parity(out["image_embeds"], want_emb, what="wan .pth: head")


def test_wan_pth_from_transformers_weights(tmp_path):
    """Transformers weights renamed to the release's names (q/k/v fused into to_qkv) in a fp16 .pth:
    the same outputs as transformers with fp16-rounded weights."""
    model = _ref_model("gelu", projection=True, layers=3, seed=4)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    sd = {k.removeprefix("vision_model."): v for k, v in model.state_dict().items()}
    wan = {
        "visual.patch_embedding.weight": sd["embeddings.patch_embedding.weight"],
        "visual.cls_embedding": sd["embeddings.class_embedding"].reshape(1, 1, -1),
        "visual.pos_embedding": sd["embeddings.position_embedding.weight"][None],
        "visual.head": sd["visual_projection.weight"].T.contiguous(),
        "textual.head.0.weight": torch.zeros(4, 4),
        "log_scale": torch.tensor(4.6),
    }
    for ours, theirs in (("pre_norm", "pre_layrnorm"), ("post_norm", "post_layernorm")):
        for s in ("weight", "bias"):
            wan[f"visual.{ours}.{s}"] = sd[f"{theirs}.{s}"]
    for i in range(3):
        a, b = f"visual.transformer.{i}.", f"encoder.layers.{i}."
        for ours, theirs in (("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("attn.proj", "self_attn.out_proj"),
                             ("mlp.0", "mlp.fc1"), ("mlp.2", "mlp.fc2")):
            for s in ("weight", "bias"):
                wan[f"{a}{ours}.{s}"] = sd[f"{b}{theirs}.{s}"]
        for s in ("weight", "bias"):
            wan[f"{a}attn.to_qkv.{s}"] = torch.cat([sd[f"{b}self_attn.{n}_proj.{s}"] for n in "qkv"])
    path = tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    torch.save({k: v.half().contiguous() for k, v in wan.items()}, path)
    x = _pixels(2, seed=5)
    ref = _ref_out(model, x)
    enc = clip.load_clip(path, num_heads=4)
    assert enc.cfg == WAN_TINY
    assert clip.detect_naming(open_checkpoint(path)) == "wan"
    out = enc(x)
    assert_parity(out["penultimate"], ref.hidden_states[-2].numpy(), what="wan fp16 .pth: hidden_states[-2]")
    assert_parity(out["last_hidden_state"], ref.last_hidden_state.numpy(), what="wan fp16 .pth: last")
    assert_parity(out["image_embeds"], ref.image_embeds.numpy(), what="wan fp16 .pth: image_embeds")
    assert_parity(enc.penultimate(x), ref.hidden_states[-2].numpy(), what="wan fp16 .pth: penultimate()")


def test_infer_config_vit_h14_shapes():
    """The release file's shapes (no data read) give Wan2.1's ViT-H/14 config."""
    def lazy(name, shape):
        return LazyTensor(name, shape, np.dtype(np.float16), lambda: (_ for _ in ()).throw(AssertionError("read")))

    names = dict(clip.wan_expected_shapes(clip.WAN_VIT_H_14))
    names.update({"textual.token_embedding.weight": (250002, 1024), "log_scale": ()})
    ck = Checkpoint({n: lazy(n, s) for n, s in names.items()}, "vit-h-14")
    assert clip.infer_config(ck) == clip.WAN_VIT_H_14
    # full-size shapes trace (no compute): 257 tokens of width 1280 from the first 31 layers
    px = jax.ShapeDtypeStruct((2, 3, 224, 224), np.float32)
    enc = clip.abstract(clip.WAN_VIT_H_14, np.float16)
    out = jax.eval_shape(lambda s, x: enc.replace(state=s).penultimate(x), enc.state, px)
    assert out.shape == (2, 257, 1280) and out.dtype == np.float32


# ------------------------------------------------------------------------------------------ errors
def test_mismatched_checkpoints_raise(tmp_path):
    model = _ref_model("quick_gelu")
    cfg = clip.CLIPVisionConfig.from_hf(model.config.to_dict())
    good = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    clip.load_params_from(good, cfg, naming="hf")  # sanity

    key = "encoder.layers.1.self_attn.k_proj.weight"
    missing = {k: v for k, v in good.items() if k != key}
    with pytest.raises(CheckpointMismatchError, match="missing.*" + key.replace(".", r"\.")):
        clip.load_params_from(missing, cfg)
    bad = dict(good, **{"encoder.layers.0.mlp.fc1.weight": np.zeros((127, 64), np.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"mis-shaped.*mlp\.fc1\.weight"):
        clip.load_params_from(bad, cfg)
    extra = dict(good, **{"encoder.layers.4.layer_norm1.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"unexpected.*encoder\.layers\.4\.layer_norm1\.weight"):
        clip.load_params_from(extra, cfg)
    # a model with a projection needs visual_projection
    with pytest.raises(CheckpointMismatchError, match=r"missing.*visual_projection\.weight"):
        clip.load_params_from(good, dataclasses.replace(cfg, projection_dim=24))

    # through the compat loader from a folder on disk
    (tmp_path / "m").mkdir()
    save_safetensors(missing, tmp_path / "m" / "model.safetensors")
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(model.config.to_dict(),
                                                                architectures=["CLIPVisionModel"])))
    with pytest.raises(CheckpointMismatchError, match=key.replace(".", r"\.")):
        load_pretrained(tmp_path / "m")

    # Wan naming: reported in the release's own names
    wan = {k: v.numpy().copy() for k, v in _WanStyleCLIP().state_dict().items()}
    clip.load_params_from(wan, WAN_TINY)  # sanity
    qkv = "visual.transformer.1.attn.to_qkv.weight"
    with pytest.raises(CheckpointMismatchError, match=r"Wan naming.*missing.*" + qkv.replace(".", r"\.")):
        clip.load_params_from({k: v for k, v in wan.items() if k != qkv}, WAN_TINY)
    with pytest.raises(CheckpointMismatchError, match=r"mis-shaped.*to_qkv\.weight \(shape \[190, 64\]"):
        clip.load_params_from(dict(wan, **{qkv: np.zeros((190, 64), np.float32)}), WAN_TINY)
    with pytest.raises(CheckpointMismatchError, match=r"unexpected.*visual\.transformer\.3\.norm1\.weight"):
        clip.load_params_from(dict(wan, **{"visual.transformer.3.norm1.weight": np.ones(64, np.float32)}), WAN_TINY)
    path = tmp_path / "bad.pth"
    torch.save({k: torch.from_numpy(v) for k, v in wan.items() if k != qkv}, path)
    with pytest.raises(CheckpointMismatchError, match=r"bad\.pth.*" + qkv.replace(".", r"\.")):
        clip.load_clip(path, WAN_TINY)


# ------------------------------------------------------------------------------------------ preprocessing
def _random_images(rng):
    shapes = [(300, 400), (224, 224), (180, 640), (97, 150), (500, 230), (225, 224), (64, 64)]
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]


def _ref_processor(**kw):
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(**kw)


def test_preprocess_matches_clip_image_processor():
    rng = np.random.default_rng(0)
    ref = _ref_processor()
    errs = []
    imgs = _random_images(rng)
    for a in imgs:
        want = ref(images=a, return_tensors="np")["pixel_values"]
        for inp in (a, PIL_Image.fromarray(a), [a]):
            got = clip.preprocess(inp)
            assert got.shape == (1, 3, 224, 224) and got.dtype == np.float32
            errs.append(float(np.abs(got - want).max()))
    # a batch array, RGBA (composited onto white), grayscale, palette with transparency
    batch = rng.integers(0, 256, (2, 240, 320, 3), dtype=np.uint8)
    want = ref(images=list(batch), return_tensors="np")["pixel_values"]
    errs.append(float(np.abs(clip.preprocess(batch) - want).max()))
    rgba = rng.integers(0, 256, (200, 260, 4), dtype=np.uint8)
    for inp in (rgba, PIL_Image.fromarray(rgba, "RGBA")):
        errs.append(float(np.abs(clip.preprocess(inp) - ref(images=inp, return_tensors="np")["pixel_values"]).max()))
    gray = PIL_Image.fromarray(rng.integers(0, 256, (230, 250), dtype=np.uint8), "L")
    errs.append(float(np.abs(clip.preprocess(gray) - ref(images=gray, return_tensors="np")["pixel_values"]).max()))
    pal = PIL_Image.fromarray(imgs[0]).convert("P")
    pal.info["transparency"] = 3
    errs.append(float(np.abs(clip.preprocess(pal) - ref(images=pal, return_tensors="np")["pixel_values"]).max()))
    # mixed list of sizes -> one batch
    want = ref(images=imgs[:3], return_tensors="np")["pixel_values"]
    errs.append(float(np.abs(clip.preprocess(imgs[:3]) - want).max()))
    print(f"preprocess vs {type(ref).__name__}: max abs err {max(errs):.3e} over {len(errs)} comparisons")
    assert max(errs) <= 1e-6
    with pytest.raises(TypeError, match="uint8"):
        clip.preprocess(np.zeros((50, 50, 3), np.float32))


def test_pipeline_encode_image_end_to_end(tmp_path):
    """diffusers' WanImageToVideoPipeline.encode_image: image_processor -> image_encoder(...,
    output_hidden_states=True).hidden_states[-2], on a tiny encoder (32 px)."""
    model = _ref_model("gelu", seed=6)
    model.save_pretrained(tmp_path)
    rng = np.random.default_rng(1)
    images = [PIL_Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)),
              PIL_Image.fromarray(rng.integers(0, 256, (70, 40, 3), dtype=np.uint8))]
    proc = _ref_processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    with torch.no_grad():
        want = model(**proc(images=images, return_tensors="pt"), output_hidden_states=True).hidden_states[-2].numpy()
    px = clip.preprocess(images, size=32, crop_size=32)
    assert_parity(load_pretrained(tmp_path).penultimate(px), want, what="encode_image end to end")


def test_preprocess_vs_torchvision_backend():
    """transformers 5 ``CLIPImageProcessor`` resizes with torchvision when it is installed (the PIL
    backend otherwise). Its antialiased uint8 bicubic differs from PIL's by rounding: measured
    <= 2 uint8 levels (0.030 after normalisation) on smooth images; white noise in portrait
    orientation reaches ~20 levels, so smooth images are compared here."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or unusable (e.g. a CUDA build without its libraries)
        pytest.skip("torchvision not available")
    ref = transformers.CLIPImageProcessor()
    if getattr(ref, "backend", "pil") != "torchvision":
        pytest.skip("CLIPImageProcessor is not the torchvision backend here")
    errs = []
    for h, w in [(300, 400), (180, 640), (97, 150), (500, 230), (480, 832)]:
        yy, xx = np.mgrid[0:h, 0:w]
        a = np.stack([127.5 + 127.5 * np.sin(xx / 37.0 + c) * np.cos(yy / 23.0 - c) for c in range(3)], -1)
        a = a.round().astype(np.uint8)
        errs.append(float(np.abs(clip.preprocess(a) - ref(images=a, return_tensors="np")["pixel_values"]).max()))
    print(f"preprocess vs torchvision backend (smooth images): max abs err {max(errs):.3e}")
    assert max(errs) <= 0.05
