"""Parity of the CogVideoX DiT with diffusers' CogVideoXTransformer3DModel (2B sin-cos, 5B rotary,
5B-I2V learned positions, 1.5 I2V with patch_t=2 + ofs), its positional tables, the original (SAT)
release names, compile counts and loading errors."""

import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.weights import CheckpointMismatchError

# tiny, non-square sample grid; heads x head_dim = 32 (divisible by 16 for the sin-cos table)
BASE = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=24,
            text_embed_dim=20, num_layers=2, sample_width=12, sample_height=8, sample_frames=9,
            max_text_seq_length=7)
VARIANTS = {
    "2b": dict(),  # fixed 3D sin-cos positions on the joint sequence
    "5b": dict(use_rotary_positional_embeddings=True),
    "5b-i2v": dict(in_channels=8, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True),
    "1.5-i2v": dict(in_channels=8, use_rotary_positional_embeddings=True, patch_size_t=2, patch_bias=False,
                    ofs_embed_dim=24, sample_height=12, sample_width=16),
    "1.5": dict(use_rotary_positional_embeddings=True, patch_size_t=2, patch_bias=False, sample_height=12,
                sample_width=16, norm_elementwise_affine=False, attention_bias=False),
}


def _ref(variant, **over):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    m = CogVideoXTransformer3DModel(**{**BASE, **VARIANTS[variant], **over})
    m = perturb(m, seed=1)
    if getattr(m.patch_embed, "pos_embedding", None) is not None and m.config.use_learned_positional_embeddings:
        with torch.no_grad():  # a learned table (trained, not the sin-cos init)
            m.patch_embed.pos_embedding.add_(0.1 * torch.randn(m.patch_embed.pos_embedding.shape))
    return m


def _rope(cfg, f, h, w):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p, pt = cfg["patch_size"] if "patch_size" in cfg else 2, cfg.get("patch_size_t")
    gh, gw = h // p, w // p
    bw, bh = cfg["sample_width"] // p, cfg["sample_height"] // p
    if pt is None:
        crops = get_resize_crop_region_for_grid((gh, gw), bw, bh)
        return get_3d_rotary_pos_embed(cfg["attention_head_dim"], crops, (gh, gw), f)
    return get_3d_rotary_pos_embed(cfg["attention_head_dim"], None, (gh, gw), (f + pt - 1) // pt, grid_type="slice",
                                   max_size=(bh, bw))


def _inputs(cfg, b=2, f=3, h=8, w=12, lt=None, seed=0):
    rng = np.random.default_rng(seed)
    kw = dict(hidden_states=rng.standard_normal((b, f, cfg["in_channels"], h, w)).astype(np.float32),
              encoder_hidden_states=rng.standard_normal((b, lt or cfg["max_text_seq_length"],
                                                         cfg["text_embed_dim"])).astype(np.float32),
              timestep=np.array([999, 321][:b], np.int64))
    if cfg.get("use_rotary_positional_embeddings"):
        kw["image_rotary_emb"] = tuple(to_numpy(t) for t in _rope(cfg, f, h, w))
    if cfg.get("ofs_embed_dim"):
        kw["ofs"] = np.array([2.0], np.float32)
    return kw


def _run_ref(model, kw):
    tkw = {k: (tuple(torch.from_numpy(a) for a in v) if isinstance(v, tuple) else torch.from_numpy(v))
           for k, v in kw.items()}
    with torch.no_grad():
        return to_numpy(model(**tkw, return_dict=False)[0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each variant's reference model, saved with save_pretrained."""
    out = {}
    for v in VARIANTS:
        ref = _ref(v)
        path = tmp_path_factory.mktemp(f"cog-{v}")
        ref.save_pretrained(path)
        out[v] = (ref, path)
    return out


@pytest.mark.parametrize("variant,shape", [
    ("2b", dict(f=3, h=8, w=12)),  # the config's sample size: the table the reference keeps
    ("2b", dict(f=2, h=6, w=10)),  # another size: recomputed
    ("5b", dict(f=3, h=10, w=6)),
    ("5b-i2v", dict(f=3, h=8, w=12)),  # native size: the learned table
    ("5b-i2v", dict(f=2, h=8, w=12)),  # other frame count: the reference falls back to sin-cos
    ("1.5-i2v", dict(f=4, h=8, w=12)),
    ("1.5", dict(f=2, h=12, w=6)),
])
def test_parity(saved, variant, shape):
    ref, path = saved[variant]
    cfg = {**BASE, **VARIANTS[variant]}
    kw = _inputs(cfg, **shape)
    out = compat.load_pretrained(path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what=f"CogVideoXTransformer3DModel {variant} {shape}")


def test_rotary_text_length_free(saved):
    """Rotary models take any text length (only the positional variants need max_text_seq_length)."""
    ref, path = saved["5b"]
    cfg = {**BASE, **VARIANTS["5b"]}
    kw = _inputs(cfg, b=1, lt=5)
    assert_parity(compat.load_pretrained(path).forward(**kw), _run_ref(ref, kw), what="5B, 5 text tokens")
    with pytest.raises(ValueError, match="max_text_seq_length=7"):
        compat.load_pretrained(saved["2b"][1]).forward(**_inputs({**BASE}, b=1, lt=5))
    with pytest.raises(ValueError, match="learned positional embeddings"):
        compat.load_pretrained(saved["5b-i2v"][1]).forward(**_inputs({**BASE, **VARIANTS["5b-i2v"]}, b=1, h=10))


@pytest.mark.parametrize("grid_type", ["linspace", "slice"])
def test_rope_tables_match_diffusers(grid_type):
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    from vidax.models.cogvideox.dit import resize_crop_region, rope_3d

    for (f, gh, gw), base in [((13, 30, 45), (30, 45)), ((7, 17, 40), (30, 45)), ((11, 48, 85), (150, 150))]:
        if grid_type == "linspace":
            crops = resize_crop_region((gh, gw), base[1], base[0])
            ref = get_3d_rotary_pos_embed(64, crops, (gh, gw), f)
            out = rope_3d(64, (f, gh, gw), crops_coords=crops)
        else:
            ref = get_3d_rotary_pos_embed(64, None, (gh, gw), f, grid_type="slice", max_size=base)
            out = rope_3d(64, (f, gh, gw), grid_type="slice", max_size=base)
        for o, r, n in zip(out, ref, ("cos", "sin")):
            assert_parity(o, to_numpy(r), tol=1e-5, what=f"rope {grid_type} {n} {(f, gh, gw)}")


def test_sincos_table_matches_diffusers():
    from diffusers.models.embeddings import get_3d_sincos_pos_embed

    from vidax.models.cogvideox.dit import CogVideoXConfig, sincos_table

    cfg = CogVideoXConfig()
    ref = get_3d_sincos_pos_embed(cfg.dim, (11, 7), 4, 1.875, 1.0).flatten(0, 1)
    assert_parity(sincos_table(cfg, (4, 7, 11)), to_numpy(ref), tol=1e-6, what="3D sin-cos table")


def _to_sat(sd: dict, cfg) -> dict:
    """diffusers names -> the original (SAT) release names: the inverse of diffusers'
    scripts/convert_cogvideox_to_diffusers.py (fused q/k/v; both modulations in one 12-way table)."""
    from vidax.models.cogvideox.convert import SAT_PREFIX, sat_names

    inv = {v: k for k, v in sat_names(cfg).items()}
    out = {}
    for i in range(cfg.num_layers):
        b = f"transformer_blocks.{i}."
        for wb in ("weight", "bias"):
            if f"{b}attn1.to_q.{wb}" in sd:
                out[f"transformer.layers.{i}.attention.query_key_value.{wb}"] = np.concatenate(
                    [sd.pop(f"{b}attn1.to_{n}.{wb}") for n in "qkv"], axis=0)
            n1, n2 = np.split(sd.pop(f"{b}norm1.linear.{wb}"), 6), np.split(sd.pop(f"{b}norm2.linear.{wb}"), 6)
            out[f"mixins.adaln_layer.adaLN_modulations.{i}.1.{wb}"] = np.concatenate(
                n1[0:3] + n2[0:3] + n1[3:6] + n2[3:6], axis=0)
    out.update({inv[k]: v for k, v in sd.items()})
    if cfg.use_rotary_positional_embeddings and not cfg.patch_size_t:  # rotary buffers the converter drops
        out["mixins.pos_embed.freqs_sin"] = out["mixins.pos_embed.freqs_cos"] = np.zeros((4, 16), np.float32)
    return {SAT_PREFIX + k: v for k, v in out.items()}


@pytest.mark.parametrize("variant", ["5b", "1.5-i2v"])
def test_original_release_names(tmp_path, saved, variant):
    import jax
    import jax.numpy as jnp

    from vidax.models.cogvideox.dit import CogVideoXConfig, forward, load_dit, rope_tables
    from vidax.weights import save_safetensors

    ref, _ = saved[variant]
    cfg = CogVideoXConfig.from_diffusers(dict(ref.config))
    sat = _to_sat({k: to_numpy(v) for k, v in ref.state_dict().items()}, cfg)
    assert not any(".to_q." in k or "norm1.linear" in k for k in sat)
    if variant == "5b":  # the release's DeepSpeed file: a torch zip pickle, the weights under "module"
        path = tmp_path / "mp_rank_00_model_states.pt"
        torch.save({"module": {k: torch.from_numpy(v) for k, v in sat.items()}}, path)
    else:
        path = tmp_path / "model.safetensors"
        save_safetensors(sat, path)
    state, cfg2 = load_dit(path, cfg)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(state))
    kw = _inputs({**BASE, **VARIANTS[variant]}, f=4 if cfg.patch_size_t else 3)
    x = jnp.asarray(kw["hidden_states"]).transpose(0, 1, 3, 4, 2)
    rope = tuple(jnp.asarray(a) for a in kw["image_rotary_emb"])
    out = forward(jax.device_put(state), cfg2, x, kw["timestep"], kw["encoder_hidden_states"], kw.get("ofs"), rope)
    assert_parity(np.asarray(out).transpose(0, 1, 4, 2, 3), _run_ref(ref, kw), what=f"{variant} from SAT names")
    # the pipeline's own rotary tables are the reference pipeline's
    g = (x.shape[1] // cfg.pt, x.shape[2] // 2, x.shape[3] // 2)
    for a, b in zip(rope_tables(cfg, g), kw["image_rotary_emb"]):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # inferring the config from the tensor shapes alone gets the architecture right
    _, inferred = load_dit(path)
    for f in ("num_heads", "head_dim", "num_layers", "in_channels", "out_channels", "patch_size_t", "ofs_embed_dim",
              "time_embed_dim", "text_embed_dim", "patch_bias", "use_rotary_positional_embeddings"):
        assert getattr(inferred, f) == getattr(cfg, f), f


def test_forward_compiles_once_over_ten_calls():
    import jax
    import jax.numpy as jnp

    from vidax.core.jit import CompileCounter
    from vidax.models.cogvideox.dit import PRESETS, forward, init_state

    cfg = PRESETS["tiny"]
    params = jax.tree.map(jnp.asarray, init_state(cfg, seed=0))
    fwd = jax.jit(forward, static_argnums=1)
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((1, 3, 4, 6, cfg.in_channels)), jnp.float32) for _ in range(10)]
    ctx = jnp.asarray(rng.standard_normal((1, cfg.max_text_seq_length, cfg.text_embed_dim)), jnp.float32)
    with CompileCounter() as cc:
        for i, x in enumerate(xs):
            fwd(params, cfg, x, jnp.asarray([999.0 - 50 * i]), ctx).block_until_ready()
    print("compiles over 10 DiT calls:", cc.count)
    assert cc.count == 1


@pytest.mark.parametrize("fault", ["missing", "extra", "misshaped"])
def test_mismatched_checkpoint_is_reported(tmp_path, fault):
    from safetensors.numpy import load_file, save_file

    ref = _ref("5b")
    ref.save_pretrained(tmp_path)
    f = tmp_path / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "transformer_blocks.1.attn1.to_q.weight"
    if fault == "missing":
        del sd[key]
    elif fault == "extra":
        sd["transformer_blocks.1.attn1.to_qq.weight"] = sd[key]
        key = "transformer_blocks.1.attn1.to_qq.weight"
    else:
        sd[key] = sd[key][:, :-1].copy()
    save_file(sd, f)
    with pytest.raises(CheckpointMismatchError) as e:
        compat.load_pretrained(tmp_path)
    msg = str(e.value)
    print(msg)
    assert key in msg and str(tmp_path) in msg
    assert {"missing": "1 missing", "extra": "1 unexpected", "misshaped": "1 mis-shaped"}[fault] in msg
