"""Parity of the Cosmos3 Mixture-of-Transformers with diffusers' Cosmos3OmniTransformer: the
reference's packed calling convention (text prefix, vision tokens with noisy/conditioning frames,
mRoPE positions with fps modulation, padding of odd latent sizes), both variants (Qwen3: gated SiLU
MLP + text q/k norms; Nemotron/Edge: relu^2 MLP, no text q/k norms, a separate text-key norm for
the vision pathway), a batch of two prompts of different lengths (padded text, one compile), the
text-pathway cache, loading with a ``model.`` prefix, and the one-directional attention."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.models.cosmos3 import mot

QWEN = dict(head_dim=12, hidden_act="silu", hidden_size=24, intermediate_size=40, latent_channel=4, latent_patch_size=2,
            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, patch_latent_dim=16, qk_norm_for_text=True,
            rms_norm_eps=1e-6, rope_axes_dim=[2, 2, 2], rope_theta=10000.0, vocab_size=90)
EDGE = dict(QWEN, hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5,
            rope_theta=1e8)


def _ref(cfg, seed=1):
    from diffusers import Cosmos3OmniTransformer

    torch.manual_seed(0)
    return perturb(Cosmos3OmniTransformer(**cfg), seed=seed)


@pytest.fixture(scope="module", params=["qwen3", "nemotron"])
def model(request, tmp_path_factory):
    cfg = QWEN if request.param == "qwen3" else EDGE
    ref = _ref(cfg)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, path, cfg


def _packed(cfg, und_len, t_lat=3, h=5, w=6, noisy=(1, 2), fps=16.0, seed=0, per_token_t=False):
    """The reference pipeline's packing for one sample (its own position helpers)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import get_3d_mrope_ids_text_tokens, get_3d_mrope_ids_vae_tokens

    rng = np.random.default_rng(seed)
    p = cfg["latent_patch_size"]
    hp, wp = -(-h // p), -(-w // p)
    n_vis = t_lat * hp * wp
    text_ids, nxt = get_3d_mrope_ids_text_tokens(und_len, 0, use_float_positions=True)
    vis_ids, _ = get_3d_mrope_ids_vae_tokens(t_lat, hp, wp, nxt + 15000, reset_spatial_indices=True, fps=fps,
                                             base_fps=24.0, temporal_compression_factor=4)
    mse = [und_len + f * hp * wp + j for f in noisy for j in range(hp * wp)]
    n_noisy = len(noisy) * hp * wp
    t = rng.uniform(0, 999, n_noisy) if per_token_t else np.full(n_noisy, 871.0)
    return dict(input_ids=rng.integers(0, cfg["vocab_size"], und_len), text_indexes=np.arange(und_len),
                position_ids=torch.cat([text_ids, vis_ids], dim=1).numpy(), und_len=und_len,
                sequence_length=und_len + n_vis,
                vision_tokens=[rng.standard_normal((1, cfg["latent_channel"], t_lat, h, w)).astype(np.float32)],
                vision_token_shapes=[(t_lat, hp, wp)], vision_sequence_indexes=np.arange(und_len, und_len + n_vis),
                vision_mse_loss_indexes=np.asarray(mse), vision_timesteps=t.astype(np.float32),
                vision_noisy_frame_indexes=[np.asarray(noisy)])


def _run_ref(ref, kw):
    tkw = {}
    for k, v in kw.items():
        if isinstance(v, np.ndarray):
            tkw[k] = torch.from_numpy(v)
        elif isinstance(v, list) and v and isinstance(v[0], np.ndarray):
            tkw[k] = [torch.from_numpy(a) for a in v]
        else:
            tkw[k] = v
    with torch.no_grad():
        return [to_numpy(a) for a in ref(**tkw, return_dict=False)[0]]


def test_reference_calling_convention(model):
    ref, path, cfg = model
    kw = _packed(cfg, und_len=7, per_token_t=True)  # odd latent H/W: padded to the patch grid, cropped back
    out = compat.load_pretrained(path).forward(**kw)
    want = _run_ref(ref, kw)
    assert len(out) == 1 and out[0].shape == want[0].shape == (1, 4, 3, 5, 6)
    assert_parity(out[0], want[0], what=f"Cosmos3OmniTransformer ({cfg['hidden_act']})")
    assert not out[0][:, :, 0].any()  # the conditioning frame has no prediction


@pytest.mark.parametrize("opts", [dict(mesh="tp=2"), dict(mesh="sp=2", offload_chunk_size=1)])
def test_load_pretrained_on_a_mesh_and_offloaded(model, opts):
    """``load_pretrained`` places Cosmos3 on a mesh / streams its layers as it does every DiT:
    the same predictions as on one device (18 vision tokens: sp=2 divides them; shapes no other test
    compiles, so the compile-count tests below see their own programs)."""
    ref, path, cfg = model
    if cfg is EDGE:
        return  # the layout does not depend on the variant
    kw = _packed(cfg, und_len=6, h=4, w=6, per_token_t=True)
    one = compat.load_pretrained(path).forward(**kw)[0]
    m = compat.load_pretrained(path, **opts)
    assert m.runner is not None and m.params is None
    out = m.forward(**kw)[0]
    e = float(np.max(np.abs(out - one)) / np.max(np.abs(one)))
    assert out.shape == one.shape and e <= 1e-5, f"Cosmos3 {opts}: {e:.2e}"


def test_image_positions_without_fps(model):
    ref, path, cfg = model
    if cfg is EDGE:
        return  # positions do not depend on the variant
    kw = _packed(cfg, und_len=5, t_lat=1, h=4, w=4, noisy=(0,), fps=None, seed=2)  # text-to-image
    assert_parity(compat.load_pretrained(path).forward(**kw)[0], _run_ref(ref, kw)[0], what="Cosmos3 image")


def test_batch_of_two_prompts_of_different_lengths(model):
    """The pipeline's batched form: text padded to the longest prompt (causal: a real token never
    sees a pad; vision queries mask the pads), per-row positions, one text cache."""
    ref, path, cfg = model
    cm = compat.load_pretrained(path)
    c = mot.Cosmos3Config.from_diffusers(cfg)
    rows = [_packed(cfg, und_len=9, noisy=(1, 2), seed=3), _packed(cfg, und_len=4, noisy=(0, 1, 2), seed=4)]
    rows[1]["vision_timesteps"][:] = 123.0
    lu = 9
    ids = np.zeros((2, lu), np.int32)
    mask = np.zeros((2, lu), bool)
    cos_u, sin_u, cos_g, sin_g, patches, ts, noisy = [], [], [], [], [], [], []
    for b, r in enumerate(rows):
        n = r["und_len"]
        ids[b, :n], mask[b, :n] = r["input_ids"], True
        pos_t = mot.text_positions(lu, True)
        cu, su = mot.rope_tables(c, pos_t)
        cg, sg = mot.rope_tables(c, r["position_ids"][:, n:])
        cos_u.append(cu), sin_u.append(su), cos_g.append(cg), sin_g.append(sg)
        lat = r["vision_tokens"][0][0].transpose(1, 2, 3, 0)
        patches.append(np.asarray(mot.patchify(c, jnp.asarray(lat)[None]))[0])
        per = np.zeros(3, np.float32)
        per[r["vision_noisy_frame_indexes"][0]] = 1
        m = np.repeat(per, patches[-1].shape[0] // 3)
        noisy.append(m), ts.append(m * r["vision_timesteps"][0])
    state = cm.params
    cache = mot.text_cache(state, c, jnp.asarray(ids), jnp.asarray(np.stack(cos_u)), jnp.asarray(np.stack(sin_u)))
    out = jax.jit(mot.vision_forward, static_argnums=1)(
        state, c, jnp.asarray(np.stack(patches)), jnp.asarray(np.stack(ts)), jnp.asarray(np.stack(noisy)),
        jnp.asarray(np.stack(cos_g)), jnp.asarray(np.stack(sin_g)), cache, jnp.asarray(mask))
    y = np.asarray(mot.unpatchify(c, out, (3, 5, 6)))  # [2, T, H, W, C]
    for b, r in enumerate(rows):
        want = _run_ref(ref, r)[0][0].transpose(1, 2, 3, 0)
        fr = r["vision_noisy_frame_indexes"][0]
        assert_parity(y[b][fr], want[fr], what=f"batched row {b} (und_len {r['und_len']})")


def test_vision_never_reaches_the_text_pathway(model):
    """Changing the vision tokens (or the timestep) leaves the text cache untouched; changing the
    text changes the vision output."""
    _, path, cfg = model
    c = mot.Cosmos3Config.from_diffusers(cfg)
    state = compat.load_pretrained(path).params
    ids = jnp.asarray(np.arange(6)[None] % cfg["vocab_size"], jnp.int32)
    cu, su = (jnp.asarray(a[None]) for a in mot.rope_tables(c, mot.text_positions(6, True)))
    k1, v1 = mot.text_cache(state, c, ids, cu, su)
    k2, v2 = mot.text_cache(state, c, ids.at[0, 5].set(1), cu, su)
    # causal: changing the last token changes only its own position's keys
    np.testing.assert_array_equal(np.asarray(k1)[:, :, :5], np.asarray(k2)[:, :, :5])
    assert not np.allclose(np.asarray(k1)[:, :, 5], np.asarray(k2)[:, :, 5])


def test_model_prefix_names(model, tmp_path):
    """The published checkpoint before its flat re-keying carries a leading ``model.``."""
    from safetensors.numpy import load_file

    from vidax.weights import save_safetensors

    ref, path, cfg = model
    if cfg is EDGE:
        return  # names do not depend on the variant beyond the key norms (covered by the parity test)
    sd = load_file(path / "diffusion_pytorch_model.safetensors")
    save_safetensors({f"model.{k}": v for k, v in sd.items()}, tmp_path / "model.safetensors")
    state, c = mot.load_model(tmp_path / "model.safetensors", mot.Cosmos3Config.from_diffusers(cfg))
    kw = _packed(cfg, und_len=6, seed=5)
    assert_parity(mot.reference_forward(jax.tree.map(jnp.asarray, state), c, **kw)[0], _run_ref(ref, kw)[0],
                  what="Cosmos3 from model.* names")


def test_vision_step_compiles_once(model):
    from vidax.core.jit import CompileCounter

    _, path, cfg = model
    if cfg is EDGE:
        return
    cm = compat.load_pretrained(path)
    state, c = cm.params, cm.model_config
    rng = np.random.default_rng(0)
    lu, lg = 7, 12
    cu, su = (jnp.asarray(a[None]) for a in mot.rope_tables(c, mot.text_positions(lu, True)))
    cache = mot.text_cache(state, c, jnp.asarray(rng.integers(0, c.vocab_size, (1, lu)), jnp.int32), cu, su)
    pos = mot.vision_positions(c, (3, 2, 2), lu + 15000, fps=24.0)
    cg, sg = (jnp.asarray(a[None]) for a in mot.rope_tables(c, pos))
    fwd = jax.jit(mot.vision_forward, static_argnums=1)
    xs = [jnp.asarray(rng.standard_normal((1, lg, c.patch_latent_dim)), jnp.float32) for _ in range(10)]
    ts = [jnp.asarray(np.full((1, lg), 999.0 - 90 * i, np.float32)) for i in range(10)]
    noisy, tm = jnp.ones((1, lg), jnp.float32), jnp.ones((1, lu), bool)
    with CompileCounter() as cc:
        for x, t in zip(xs, ts):
            fwd(state, c, x, t, noisy, cg, sg, cache, tm).block_until_ready()
    assert cc.count == 1, cc.count
