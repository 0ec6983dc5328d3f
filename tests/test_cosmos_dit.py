"""Parity of the Cosmos-Predict2.5 DiT with diffusers' CosmosTransformer3DModel: per-frame 5-D
timesteps, condition and padding masks, text masks, fps-scaled RoPE, learnable positions; loading
from a save_pretrained folder and from the original release's names; compile count; errors."""

import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.weights import CheckpointMismatchError, save_safetensors

# Predict2.5-shaped (Video2World: +1 condition-mask channel, padding mask, Qwen feature projection)
TINY = dict(in_channels=5, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=2, mlp_ratio=2.0,
            text_embed_dim=16, adaln_lora_dim=8, max_size=(16, 64, 64), patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0),
            concat_padding_mask=True, extra_pos_embed_type=None, use_crossattn_projection=True,
            crossattn_proj_in_channels=40, encoder_hidden_states_channels=16)


def install_torchvision_shim():
    """diffusers resizes the padding mask with torchvision (not installed here): a tensor resize with
    NEAREST is ``torch.nn.functional.interpolate(mode="nearest")`` in torchvision, so stand in with
    exactly that."""
    import types

    import diffusers.models.transformers.transformer_cosmos as tc

    if getattr(tc, "transforms", None) is not None:
        return

    def resize(img, size, interpolation=None):
        return torch.nn.functional.interpolate(img, size=list(size), mode="nearest")

    tc.transforms = types.SimpleNamespace(functional=types.SimpleNamespace(resize=resize),
                                          InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))


@pytest.fixture(scope="module")
def ref_folder(tmp_path_factory):
    install_torchvision_shim()
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(0)
    ref = perturb(CosmosTransformer3DModel(**TINY), seed=1)
    path = tmp_path_factory.mktemp("cosmos_dit")
    ref.save_pretrained(path)
    return ref, path


def _inputs(cfg, b=2, f=3, h=6, w=10, s=7, seed=0, frame_t=True, mask=True):
    rng = np.random.default_rng(seed)
    kw = dict(hidden_states=rng.standard_normal((b, cfg["in_channels"] - 1, f, h, w)).astype(np.float32),
              encoder_hidden_states=rng.standard_normal((b, s, cfg["crossattn_proj_in_channels"])).astype(np.float32))
    if frame_t:  # sigma per latent frame, different per row; conditioning frames near zero
        t = rng.uniform(0.05, 1.0, (b, 1, f, 1, 1)).astype(np.float32)
        t[0, :, 0] = 1e-4
        kw["timestep"] = t
    else:
        kw["timestep"] = np.array([0.93, 0.21][:b], np.float32)
    cm = np.zeros((b, 1, f, h, w), np.float32)
    cm[0, :, :1] = 1.0  # row 0: an image-conditioned first frame; row 1: text only
    kw["condition_mask"] = cm
    pm = np.zeros((1, 1, 8 * h, 8 * w), np.float32)
    pm[..., :, -5 * 8:] = 1.0  # a padded right border (non-square, resized to the latent grid)
    kw["padding_mask"] = pm
    if mask:
        am = np.ones((b, s), bool)
        am[1, 4:] = False  # row 1 has 4 text tokens
        kw["attention_mask"] = am
    return kw


def _run_ref(model, kw):
    with torch.no_grad():
        tkw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
        return to_numpy(model(**tkw, return_dict=False)[0])


def test_video2world_parity(ref_folder):
    ref, path = ref_folder
    kw = _inputs(TINY)
    out = compat.load_pretrained(path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="CosmosTransformer3DModel (5-D t, masks)")


def test_scalar_timesteps_fps_and_no_text_mask(ref_folder):
    ref, path = ref_folder
    kw = _inputs(TINY, f=2, h=4, w=6, frame_t=False, mask=False, seed=3)
    kw["fps"] = 16
    out = compat.load_pretrained(path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="CosmosTransformer3DModel ([B] t, fps RoPE)")


def test_learnable_positions_and_text2world_config(tmp_path):
    """Cosmos-1 style options: learnable absolute positions, no condition-mask channel, no text projection."""
    from diffusers import CosmosTransformer3DModel

    install_torchvision_shim()
    cfg = dict(TINY, in_channels=4, extra_pos_embed_type="learnable", use_crossattn_projection=False, rope_scale=(2.0, 1.0, 1.0))
    torch.manual_seed(0)
    ref = perturb(CosmosTransformer3DModel(**cfg), seed=2)
    ref.save_pretrained(tmp_path)
    kw = _inputs(cfg, f=2, h=4, w=6, seed=5)
    kw.pop("condition_mask")
    kw["hidden_states"] = np.random.default_rng(2).standard_normal((2, 4, 2, 4, 6)).astype(np.float32)
    kw["encoder_hidden_states"] = np.random.default_rng(1).standard_normal((2, 7, 16)).astype(np.float32)
    out = compat.load_pretrained(tmp_path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="CosmosTransformer3DModel (learnable positions)")


def test_original_release_names(ref_folder, tmp_path):
    import jax
    import jax.numpy as jnp
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    from vidax.models.cosmos import dit

    ref, _ = ref_folder
    sd = {k: to_numpy(v) for k, v in ref.state_dict().items()}
    cfg = dit.CosmosDiTConfig.from_diffusers(dict(ref.config))
    ren = dit.diffusers_keymap(cfg).rename(sd, dit.original_keymap(cfg))
    orig = {ren[k]: v for k, v in sd.items()}
    # the release also carries bookkeeping tensors the loader skips
    orig["net.accum_iteration"] = np.zeros((1,), np.int64)
    orig["net.pos_embedder.dim_spatial_range"] = np.arange(4, dtype=np.float32)
    # independent check of the renaming: diffusers' own converter gives back the diffusers names
    back = convert_cosmos_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in orig.items()})
    assert sorted(back) == sorted(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k].numpy(), sd[k])
    path = tmp_path / "model_ema_bf16.safetensors"
    save_safetensors(orig, path)
    # the config is inferred from the tensor shapes (heads: the release's 128-wide heads, so not here)
    from vidax.weights import open_checkpoint

    inferred = dit.config_from_original(open_checkpoint(path))
    for f in ("num_layers", "in_channels", "out_channels", "text_embed_dim", "adaln_lora_dim", "mlp_ratio",
              "crossattn_proj_in_channels", "encoder_hidden_states_channels", "use_crossattn_projection"):
        assert getattr(inferred, f) == getattr(cfg, f), f
    params, cfg2 = dit.load_dit(path, cfg)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(params))
    kw = _inputs(TINY)
    x, t, cm, pm = dit._ref_inputs(cfg, kw["hidden_states"], kw["timestep"], kw["condition_mask"], kw["padding_mask"])
    out = dit.forward(jax.tree.map(jnp.asarray, params), cfg2, x, t, jnp.asarray(kw["encoder_hidden_states"]),
                      cond_mask=cm, pad_mask=pm, ctx_mask=jnp.asarray(kw["attention_mask"]))
    assert_parity(np.asarray(out).transpose(0, 4, 1, 2, 3), _run_ref(ref, kw), what="Cosmos DiT from original names")


def test_forward_compiles_once_over_ten_calls(ref_folder):
    import jax
    import jax.numpy as jnp

    from vidax.core.jit import CompileCounter
    from vidax.models.cosmos import dit

    cm = compat.load_pretrained(ref_folder[1])
    params, cfg = cm.params, cm.model_config
    fwd = jax.jit(dit.forward, static_argnums=1)
    rng = np.random.default_rng(0)
    ctx = jnp.asarray(rng.standard_normal((1, 5, cfg.context_dim)), jnp.float32)
    cm_ = jnp.zeros((1, 2, 4, 4, 1), jnp.float32)
    xs = [jnp.asarray(rng.standard_normal((1, 2, 4, 4, cfg.in_channels - 1)), jnp.float32) for _ in range(10)]
    ts = [jnp.asarray(np.full((1, 2), 1.0 - 0.1 * i, np.float32)) for i in range(10)]
    with CompileCounter() as cc:
        for x, t in zip(xs, ts):
            fwd(params, cfg, x, t, ctx, cond_mask=cm_).block_until_ready()
    print("compiles over 10 DiT calls:", cc.count)
    assert cc.count == 1


@pytest.mark.parametrize("fault", ["missing", "misshaped"])
def test_mismatched_checkpoint_is_reported(ref_folder, tmp_path, fault):
    import shutil

    from safetensors.numpy import load_file, save_file

    _, src = ref_folder
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    f = tmp_path / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "transformer_blocks.1.attn2.to_k.weight"
    if fault == "missing":
        del sd[key]
    else:
        sd[key] = sd[key][:, :-1].copy()
    save_file(sd, f)
    with pytest.raises(CheckpointMismatchError, match=key.replace(".", r"\.")) as e:
        compat.load_pretrained(tmp_path)
    assert {"missing": "1 missing", "misshaped": "1 mis-shaped"}[fault] in str(e.value)
