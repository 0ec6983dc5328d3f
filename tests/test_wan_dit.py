"""Parity of the Wan DiT with diffusers' WanTransformer3DModel, plus compile counts and loading errors."""

import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.weights import CheckpointMismatchError, save_safetensors

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=24, freq_dim=32, ffn_dim=40, num_layers=3, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=32)


def _ref(**over):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return perturb(WanTransformer3DModel(**{**TINY, **over}), seed=1)


def _inputs(cfg, b=2, f=3, h=6, w=8, lt=7, seed=0, image=None):
    rng = np.random.default_rng(seed)
    kw = dict(
        hidden_states=rng.standard_normal((b, cfg["in_channels"], f, h, w)).astype(np.float32),
        timestep=np.array([999.0, 321.5][:b], np.float32),
        encoder_hidden_states=rng.standard_normal((b, lt, cfg["text_dim"])).astype(np.float32),
    )
    if image is not None:
        kw["encoder_hidden_states_image"] = rng.standard_normal((b, *image)).astype(np.float32)
    return kw


def _run_ref(model, kw):
    with torch.no_grad():
        tkw = {k: torch.from_numpy(v) for k, v in kw.items()}
        return to_numpy(model(**tkw, return_dict=False)[0])


def test_t2v_parity(tmp_path):
    ref = _ref()
    ref.save_pretrained(tmp_path)
    kw = _inputs(TINY)
    out = compat.load_pretrained(tmp_path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="WanTransformer3DModel T2V")


def test_sharded_checkpoint_and_no_cross_attn_norm(tmp_path):
    ref = _ref(cross_attn_norm=False, patch_size=(1, 2, 2), num_layers=2)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert list(tmp_path.glob("*.safetensors.index.json")), "expected a sharded checkpoint"
    kw = _inputs({**TINY}, b=1, f=2, h=4, w=4)
    out = compat.load_pretrained(tmp_path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="WanTransformer3DModel sharded, no cross-attn norm")


def test_original_release_names(tmp_path):
    import jax
    import jax.numpy as jnp
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from vidax.models.wan.dit import WanDiTConfig, diffusers_keymap, load_dit, original_keymap, forward

    ref = _ref()
    sd = {k: to_numpy(v) for k, v in ref.state_dict().items()}
    cfg = WanDiTConfig.from_diffusers(dict(ref.config))
    ren = diffusers_keymap(cfg).rename(sd, original_keymap(cfg))
    orig = {ren[k]: v for k, v in sd.items()}
    # independent check of the renaming: diffusers' own converter must give back the diffusers names
    back = convert_wan_transformer_to_diffusers({k: torch.from_numpy(v) for k, v in orig.items()})
    assert sorted(back) == sorted(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k].numpy(), sd[k])
    path = tmp_path / "wan2.1_t2v.safetensors"
    save_safetensors(orig, path)
    params, cfg2 = load_dit(path, cfg)
    # read into host memory only: no random init, nothing on a device yet
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(params))
    kw = _inputs(TINY)
    x = jnp.asarray(kw["hidden_states"]).transpose(0, 2, 3, 4, 1)
    out = np.asarray(forward(params, cfg2, x, kw["timestep"], kw["encoder_hidden_states"])).transpose(0, 4, 1, 2, 3)
    assert_parity(out, _run_ref(ref, kw), what="WanTransformer3DModel from original names")


def test_i2v_image_branch_parity(tmp_path):
    ref = _ref(image_dim=20, added_kv_proj_dim=TINY["num_attention_heads"] * TINY["attention_head_dim"])
    ref.save_pretrained(tmp_path)
    # diffusers hardcodes a 512-token text context when splitting image and text tokens
    kw = _inputs(TINY, b=1, lt=512, image=(5, 20))
    out = compat.load_pretrained(tmp_path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="WanTransformer3DModel I2V")


def test_flf2v_image_positions_parity(tmp_path):
    """FLF2V: the first and last frame's CLIP tokens ([2B, S, D]) are joined per sample and get
    learned positions (``pos_embed_seq_len`` = 2S) before the image branch."""
    ref = _ref(image_dim=20, added_kv_proj_dim=TINY["num_attention_heads"] * TINY["attention_head_dim"],
               pos_embed_seq_len=10)
    ref.save_pretrained(tmp_path)
    kw = _inputs(TINY, b=1, lt=512)
    kw["encoder_hidden_states_image"] = np.random.default_rng(4).standard_normal((2, 5, 20)).astype(np.float32)
    out = compat.load_pretrained(tmp_path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="WanTransformer3DModel FLF2V")


@pytest.mark.parametrize("channels", [4, 48])
def test_per_token_timesteps_parity(tmp_path, channels):
    """Wan2.2 TI2V feeds one timestep per token (48 latent channels in the TI2V-5B config)."""
    ref = _ref(in_channels=channels, out_channels=channels)
    ref.save_pretrained(tmp_path)
    kw = _inputs({**TINY, "in_channels": channels}, b=2, f=2, h=4, w=4)
    rng = np.random.default_rng(3)
    kw["timestep"] = rng.uniform(0, 1000, (2, 2 * 2 * 2)).astype(np.float32)
    out = compat.load_pretrained(tmp_path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="WanTransformer3DModel per-token t")


def test_forward_compiles_once_over_ten_calls(tmp_path):
    import jax
    import jax.numpy as jnp

    from vidax.core.jit import CompileCounter
    from vidax.models.wan.dit import PRESETS, forward, init_state

    cfg = PRESETS["tiny"]
    params = jax.tree.map(jnp.asarray, init_state(cfg, seed=0))
    fwd = jax.jit(forward, static_argnums=1)
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((1, 2, 4, 4, cfg.in_channels)), jnp.float32) for _ in range(10)]
    ts = [jnp.asarray([1000.0 - 100 * i], jnp.float32) for i in range(10)]
    ctx = jnp.asarray(rng.standard_normal((1, 8, cfg.text_dim)), jnp.float32)
    with CompileCounter() as cc:
        for x, t in zip(xs, ts):
            fwd(params, cfg, x, t, ctx).block_until_ready()
    print("compiles over 10 DiT calls:", cc.count)
    assert cc.count == 1


@pytest.mark.parametrize("fault", ["missing", "extra", "misshaped"])
def test_mismatched_checkpoint_is_reported(tmp_path, fault):
    from safetensors.numpy import load_file, save_file

    ref = _ref(num_layers=2)
    ref.save_pretrained(tmp_path)
    f = tmp_path / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "blocks.1.attn1.to_q.weight"
    if fault == "missing":
        del sd[key]
    elif fault == "extra":
        sd["blocks.1.attn1.to_qq.weight"] = sd[key]
        key = "blocks.1.attn1.to_qq.weight"
    else:
        sd[key] = sd[key][:, :-1].copy()
    save_file(sd, f)
    with pytest.raises(CheckpointMismatchError) as e:
        compat.load_pretrained(tmp_path)
    msg = str(e.value)
    print(msg)
    assert key in msg
    assert {"missing": "1 missing", "extra": "1 unexpected", "misshaped": "1 mis-shaped"}[fault] in msg
