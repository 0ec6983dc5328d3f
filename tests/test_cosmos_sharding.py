"""Scale parity of both Cosmos models on 8 fake CPU devices: Megatron TP, Ulysses SP, TP x SP and
offloaded layers equal the one-device forward (max abs err <= 1e-5 x max|ref|), weights really split;
and the pipelines' sampling on a mesh / offloaded equals one device."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax.core import sharding as vsh
from vidax.models.cosmos import dit as cdit
from vidax.models.cosmos3 import mot

TOL = 1e-5


def _biased(state, seed):
    """init_state plus clearly non-zero biases (a bias added tp times cannot hide)."""
    rng = np.random.default_rng(seed)
    paths, (leaves, tree) = vsh.tree_paths(state), jax.tree.flatten(state)
    return jax.tree.unflatten(tree, [l + (0.1 * rng.standard_normal(l.shape)).astype(l.dtype) if p.endswith(".bias")
                                     else l for p, l in zip(paths, leaves)])


def _close(out, ref, what):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    e = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    print(f"{what}: max abs err / max|ref| = {e:.2e}")
    assert out.shape == ref.shape and e <= TOL, f"{what}: {e:.2e}"


# ----------------------------------------------------------------------------------- Predict2.5 DiT
PCFG = cdit.CosmosDiTConfig(num_heads=8, head_dim=12, num_layers=2, text_embed_dim=16, adaln_lora_dim=8, in_channels=5,
                            out_channels=4, max_size=(16, 64, 64), crossattn_proj_in_channels=24,
                            encoder_hidden_states_channels=16)


@pytest.fixture(scope="module")
def predict():
    state = _biased(cdit.init_state(PCFG, seed=0), 1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 2, 8, 8, 4)), jnp.float32)
    t = jnp.asarray([[1e-4, 0.7], [0.4, 0.4]], jnp.float32)  # per frame, row 0 image-conditioned
    ctx = jnp.asarray(rng.standard_normal((2, 6, 24)), jnp.float32)
    cm = jnp.zeros((2, 2, 8, 8, 1), jnp.float32).at[0, 0].set(1.0)
    cmask = jnp.asarray(np.array([[1] * 6, [1] * 3 + [0] * 3], bool))
    kw = dict(cond_mask=cm, ctx_mask=cmask)
    ref = jax.jit(cdit.forward, static_argnums=1)(jax.tree.map(jnp.asarray, state), PCFG, x, t, ctx, **kw)
    return state, (x, t, ctx), kw, np.asarray(ref)


@pytest.mark.parametrize("spec,chunk", [("tp=8", None), ("sp=4", None), ("dp=2,tp=2,sp=2", None), ("tp=2,sp=2", 1)])
def test_predict25_dit_scaled(predict, spec, chunk):
    state, (x, t, ctx), kw, ref = predict
    runner = cdit.runner(state, PCFG, spec, offload_chunk_size=chunk)
    _close(runner(x, t, ctx, **kw), ref, f"Cosmos DiT {spec} offload={chunk}")
    if spec and "tp" in spec and chunk is None:
        tp = int(spec.split("tp=")[1].split(",")[0])
        q = runner.stacks["blocks"]["attn1"]["q"]["kernel"].get_value()
        assert q.addressable_shards[0].data.shape == (PCFG.num_layers, PCFG.dim, PCFG.dim // tp)


# ----------------------------------------------------------------------------------- Cosmos3 MoT
MCFG = mot.Cosmos3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=8, vocab_size=64, latent_channel=4, patch_latent_dim=16,
                         rope_axes_dim=(2, 1, 1), rope_theta=10000.0, attention_bias=True)


@pytest.fixture(scope="module")
def cosmos3():
    state = _biased(mot.init_state(MCFG, seed=3), 4)
    rng = np.random.default_rng(1)
    lu, grid = 7, (2, 2, 2)
    ids = jnp.asarray(rng.integers(0, 64, (2, lu)), jnp.int32)
    tmask = jnp.asarray(np.array([[1] * 7, [1] * 4 + [0] * 3], bool))
    cu, su = mot.rope_tables(MCFG, mot.text_positions(lu, True))
    cu, su = jnp.asarray(np.stack([cu, cu])), jnp.asarray(np.stack([su, su]))
    tabs = [mot.rope_tables(MCFG, mot.vision_positions(MCFG, grid, mot.vision_offset(MCFG, n), fps=16.0)) for n in (7, 4)]
    cg, sg = jnp.asarray(np.stack([a for a, _ in tabs])), jnp.asarray(np.stack([b for _, b in tabs]))
    lg = 8
    patches = jnp.asarray(rng.standard_normal((2, lg, 16)), jnp.float32)
    noisy = jnp.asarray(np.array([[0] * 4 + [1] * 4, [1] * 8], np.float32))
    t = noisy * jnp.asarray([[900.0], [300.0]])
    s = jax.tree.map(jnp.asarray, state)
    cache = mot.text_cache(s, MCFG, ids, cu, su)
    ref = jax.jit(mot.vision_forward, static_argnums=1)(s, MCFG, patches, t, noisy, cg, sg, cache, tmask)
    return state, (ids, cu, su), (patches, t, noisy, cg, sg, tmask), cache, np.asarray(ref)


@pytest.mark.parametrize("spec,chunk", [("tp=2", None), ("sp=4", None), ("dp=2,tp=2,sp=2", None), ("tp=2,sp=2", 1)])
def test_cosmos3_scaled(cosmos3, spec, chunk):
    state, text, vis, cache_ref, ref = cosmos3
    runner = mot.runner(state, MCFG, spec, offload_chunk_size=chunk)
    ctx = mot.text_cache(runner, MCFG, *text)
    kv = ctx["gen"] if chunk is None else {n: np.concatenate([c[n] for c in ctx["gen"]]) for n in ("k", "v")}
    _close(kv["k"], cache_ref[0], f"Cosmos3 text cache {spec} offload={chunk}")
    patches, t, noisy, cg, sg, tmask = vis
    _close(mot.vision(runner, MCFG, patches, t, noisy, cg, sg, ctx, tmask), ref, f"Cosmos3 vision {spec} offload={chunk}")


def test_cosmos3_indivisible_mesh_fails_before_compute(cosmos3):
    from vidax.core.mesh import ShardingConfigError

    state = cosmos3[0]
    with pytest.raises(ShardingConfigError, match="num_key_value_heads"):
        mot.runner(state, MCFG, "tp=4")


# ----------------------------------------------------------------------------------- pipelines
def test_predict25_pipeline_sampling_mesh_and_offload():
    from vidax.models.cosmos.pipeline import CosmosPredict

    base = CosmosPredict("tiny")
    cond = np.random.default_rng(0).standard_normal((1, 12, 72)).astype(np.float32)
    kw = dict(height=32, width=32, num_frames=5, steps=2, guidance=3.0, seed=1)
    ref = base.sample_latents(cond, cond[::-1] * 0.5, **kw)
    # CFG-parallel (the conditional / unconditional rows on dp), heads on tp, blocks streamed
    out = CosmosPredict("tiny", mesh="dp=2,tp=2", offload_chunk_size=1).sample_latents(cond, cond[::-1] * 0.5, **kw)
    _close(out, ref, "Predict2.5 sampling dp=2,tp=2 + offload")


def test_cosmos3_pipeline_sampling_mesh_and_offload():
    from vidax.models.cosmos3.pipeline import Cosmos3Omni

    base = Cosmos3Omni("tiny")
    ids = [[5, 6, 7, 8, 9, 1, 2], [9, 9, 1, 2]]
    kw = dict(height=64, width=64, num_frames=5, steps=2, guidance=3.0, seed=2, fps=24.0)
    ref = base.sample_latents(ids[:1], ids[1:], **kw)
    out = Cosmos3Omni("tiny", mesh="dp=2,sp=2", offload_chunk_size=1).sample_latents(ids[:1], ids[1:], **kw)
    _close(out, ref, "Cosmos3 sampling dp=2,sp=2 + offload")
