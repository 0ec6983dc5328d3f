"""CogVideoX on 8 fake CPU devices: Megatron TP, joint sequence parallelism (Ulysses over the video
tokens only, the text tokens sliced by heads), their composition, CFG on dp and offloaded blocks all
equal the one-device output (max abs err <= 1e-5 x max|ref|)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from vidax.core import sharding as vsh
from vidax.core.jit import CompileCounter
from vidax.models.cogvideox import dit

CFG = dit.CogVideoXConfig(num_heads=8, head_dim=16, in_channels=4, out_channels=4, time_embed_dim=24,
                          text_embed_dim=20, num_layers=2, sample_width=8, sample_height=8, sample_frames=5,
                          max_text_seq_length=7)
VARIANTS = {
    "2b": CFG,  # sin-cos table sharded with the video tokens
    "5b-i2v": dataclasses.replace(CFG, in_channels=8, use_rotary_positional_embeddings=True,
                                  use_learned_positional_embeddings=True),  # learned table, rotary (linspace)
    "1.5-i2v": dataclasses.replace(CFG, in_channels=8, use_rotary_positional_embeddings=True, patch_size_t=2,
                                   patch_bias=False, ofs_embed_dim=24, sample_width=16, sample_height=16),
}
TOL = 1e-5


def _params(cfg, seed=0):
    """init_state (nothing zero or one) plus clearly non-zero biases."""
    p = dit.init_state(cfg, seed=seed)
    rng = np.random.default_rng(seed + 100)
    leaves, tree = jax.tree.flatten(p)
    out = [l + (0.1 * rng.standard_normal(l.shape)).astype(l.dtype) if path.endswith(".bias") else l
           for path, l in zip(vsh.tree_paths(p), leaves)]
    return jax.tree.unflatten(tree, out)


def _inputs(cfg, b=2, f=2, h=8, w=8, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((b, f, h, w, cfg.in_channels)), jnp.float32)
    ctx = jnp.asarray(rng.standard_normal((b, cfg.max_text_seq_length, cfg.text_embed_dim)), jnp.float32)
    t = jnp.asarray([999.0, 421.0, 80.0, 3.0][:b])
    ofs = jnp.full((1,), 2.0) if cfg.ofs_embed_dim else None
    return x, t, ctx, ofs


@pytest.fixture(scope="module")
def refs():
    out = {}
    for name, cfg in VARIANTS.items():
        params = _params(cfg)
        x, t, ctx, ofs = _inputs(cfg)
        grid = (x.shape[1] // cfg.pt, x.shape[2] // 2, x.shape[3] // 2)
        rope = dit.rope_tables(cfg, grid)
        rope = None if rope is None else tuple(jnp.asarray(a) for a in rope)
        ref = np.asarray(jax.jit(dit.forward, static_argnums=1)(jax.tree.map(jnp.asarray, params), cfg, x, t, ctx,
                                                                 ofs, rope))
        out[name] = (params, (x, t, ctx, ofs), ref)
    return out


def _close(out, ref, what):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    e = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    print(f"{what}: max abs err / max|ref| = {e:.2e}")
    assert out.shape == ref.shape and e <= TOL, f"{what}: {e:.2e}"


def test_logical_axes_give_megatron_layout():
    m = vsh.axis_rules("tp")
    b = nnx.to_pure_dict(vsh.param_specs(dit.abstract_state(CFG), m))["blocks"]
    for n in "qkv":
        assert b[n]["kernel"] == P(None, None, "tp") and b[n]["bias"] == P(None, "tp")
    assert b["o"]["kernel"] == P(None, "tp") and b["o"]["bias"] == P()  # row-parallel, bias whole
    assert b["up"]["kernel"] == P(None, None, "tp") and b["down"]["kernel"] == P(None, "tp")
    assert b["norm_q"]["scale"] == P() and b["mod1"]["kernel"] == P()  # per-head norms, modulation: replicated


@pytest.mark.parametrize("variant,spec", [
    ("2b", "tp=2"), ("2b", "sp=8"), ("2b", "tp=2,sp=4"), ("5b-i2v", "tp=4,sp=2"), ("1.5-i2v", "tp=8"),
    ("1.5-i2v", "tp=2,sp=2"),
])
def test_sharded_equals_single_device(refs, variant, spec):
    params, (x, t, ctx, ofs), ref = refs[variant]
    r = dit.runner(params, VARIANTS[variant], spec)
    _close(r(x, t, ctx, ofs), ref, f"CogVideoX {variant} {spec} ({r.parallelism})")
    tp = dict(r.mesh.shape)["tp"]
    q = r.stacks["blocks"]["q"]["kernel"].get_value()
    assert q.addressable_shards[0].data.shape == (CFG.num_layers, CFG.dim, CFG.dim // tp)


def test_text_tokens_are_never_split(refs):
    """7 text tokens on sp=4: only the video tokens are split; 30 video tokens run padded to 32
    (masked), fewer video tokens than sp devices are refused by name."""
    params, (x, t, ctx, ofs), ref = refs["2b"]
    r = dit.runner(params, CFG, "sp=4")
    assert ctx.shape[1] % 4
    _close(r(x, t, ctx), ref, "sp=4 with 7 text tokens")
    odd = jnp.asarray(np.random.default_rng(5).standard_normal((2, 2, 10, 6, 4)), jnp.float32)  # 2 x 5 x 3 = 30
    want = jax.jit(dit.forward, static_argnums=1)(jax.tree.map(jnp.asarray, params), CFG, odd, t, ctx)
    _close(r(odd, t, ctx), want, "sp=4 with 30 video tokens")
    with pytest.raises(vsh.ShardingConfigError, match="sp=8 exceeds the 4 video tokens"):
        dit.runner(params, CFG, "sp=8")(odd[:, :1, :4, :4], t, ctx)  # 1 x 2 x 2 video tokens


@pytest.mark.parametrize("variant,spec,chunk", [("2b", None, 1), ("1.5-i2v", "tp=2,sp=2", 1), ("5b-i2v", "sp=2", "all")])
def test_offload_equals_resident(refs, variant, spec, chunk):
    params, (x, t, ctx, ofs), ref = refs[variant]
    r = dit.runner(params, VARIANTS[variant], spec, offload_chunk_size=chunk)
    _close(r(x, t, ctx, ofs), ref, f"offload chunk={chunk} {spec}")
    t2 = jnp.asarray(np.asarray(t) + 1.0)
    with CompileCounter() as cc:
        r(x, t2, ctx, ofs).block_until_ready()
    assert cc.count == 0
    assert r.offload.pools["blocks"].fn._cache_size() == 1


@pytest.mark.parametrize("source,mesh,offload", [("tiny", "dp=2,sp=2", None), ("tiny-1.5-i2v", "dp=2,tp=2,sp=2", 1),
                                                 ("tiny-5b", "tp=2,sp=2", None)])
def test_sampling_sharded_matches_single_device(source, mesh, offload):
    """Whole sampling runs (CFG on dp, DPM noise, I2V conditioning) on a mesh / offloaded."""
    from vidax.models.cogvideox.pipeline import CogVideoX

    base = CogVideoX(source)
    rng = np.random.default_rng(1)
    cond = rng.standard_normal((1, base.max_text_len, 32)).astype(np.float32)
    uncond = rng.standard_normal((1, base.max_text_len, 32)).astype(np.float32)
    kw = dict(steps=2, guidance=5.0, height=64, width=64, num_frames=5, seed=2, dynamic_cfg=True)
    if base.image_to_video:
        kw["image_latents"] = rng.standard_normal((1, 4, 1, 8, 8)).astype(np.float32)
    ref = base.sample_latents(cond, uncond, **kw)
    out = CogVideoX(source, mesh=mesh, offload_chunk_size=offload).sample_latents(cond, uncond, **kw)
    err = float(np.max(np.abs(out - ref)))
    print(f"{source} mesh={mesh} offload={offload}: max abs err {err:.2e}")
    assert err <= TOL * max(1.0, float(np.max(np.abs(ref))))
