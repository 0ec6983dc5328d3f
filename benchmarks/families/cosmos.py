"""Benchmark cases for the Cosmos families: each ``fn() -> dict(component, config, vidax, reference)``
with both callables running one forward (blocking) at a realistic-but-small width."""
from __future__ import annotations

import numpy as np


def predict25_dit():
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import CosmosTransformer3DModel

    from tests.refutil import perturb
    from vidax.core import nn
    from vidax.models.cosmos import dit
    from vidax.weights import load_params

    kw = dict(in_channels=17, out_channels=16, num_attention_heads=4, attention_head_dim=128, num_layers=4,
              mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2),
              rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True, extra_pos_embed_type=None,
              use_crossattn_projection=True, crossattn_proj_in_channels=4096, encoder_hidden_states_channels=1024)
    torch.manual_seed(0)
    ref = perturb(CosmosTransformer3DModel(**kw))
    cfg = dit.CosmosDiTConfig.from_diffusers(kw)
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    state = jax.device_put(nn.fill(dit.abstract_state(cfg), load_params(sd, dit.diffusers_keymap(cfg), dit.param_shapes(cfg))))
    rng = np.random.default_rng(0)
    b, f, h, w, lt = 1, 4, 32, 32, 512
    x = rng.standard_normal((b, 16, f, h, w)).astype(np.float32)
    cm = np.zeros((b, 1, f, h, w), np.float32)
    cm[:, :, 0] = 1
    t = rng.uniform(0, 1, (b, 1, f, 1, 1)).astype(np.float32)
    ctx = rng.standard_normal((b, lt, 4096)).astype(np.float32)
    pm = np.zeros((1, 1, 8 * h, 8 * w), np.float32)
    fwd = jax.jit(dit.forward, static_argnums=1)
    xj = jnp.asarray(x.transpose(0, 2, 3, 4, 1))
    cmj, tj, cj = jnp.asarray(cm.transpose(0, 2, 3, 4, 1)), jnp.asarray(t.reshape(b, f)), jnp.asarray(ctx)
    tx = {k: torch.from_numpy(v) for k, v in dict(hidden_states=x, condition_mask=cm, timestep=t,
                                                   encoder_hidden_states=ctx, padding_mask=pm).items()}
    _shim()

    def ref_call():
        with torch.no_grad():
            ref(**tx, return_dict=False)

    return dict(component="DiT forward (vs diffusers `CosmosTransformer3DModel`)",
                config=f"Predict2.5-shaped: 4 blocks, dim 512, 4 heads, latents {f}x{h}x{w}, text {lt}x4096, per-frame t",
                vidax=lambda: fwd(state, cfg, xj, tj, cj, cond_mask=cmj).block_until_ready(), reference=ref_call)


def cosmos3_mot():
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import Cosmos3OmniTransformer
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import get_3d_mrope_ids_text_tokens, get_3d_mrope_ids_vae_tokens

    from tests.refutil import perturb
    from vidax.core import nn
    from vidax.models.cosmos3 import mot
    from vidax.weights import load_params

    kw = dict(head_dim=128, hidden_act="silu", hidden_size=512, intermediate_size=1536, latent_channel=48,
              latent_patch_size=2, num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2,
              patch_latent_dim=192, qk_norm_for_text=True, vocab_size=4096)
    torch.manual_seed(0)
    ref = perturb(Cosmos3OmniTransformer(**kw))
    cfg = mot.Cosmos3Config.from_diffusers(kw)
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    state = jax.device_put(nn.fill(mot.abstract_state(cfg), load_params(sd, mot.keymap(cfg), mot.param_shapes(cfg))))
    rng = np.random.default_rng(0)
    lu, (t_lat, h, w) = 256, (3, 32, 32)
    grid = (t_lat, h // 2, w // 2)
    n_vis = t_lat * grid[1] * grid[2]
    ti, nxt = get_3d_mrope_ids_text_tokens(lu, 0, use_float_positions=True)
    vi, _ = get_3d_mrope_ids_vae_tokens(*grid, nxt + 15000, fps=24.0, base_fps=24.0)
    pos = torch.cat([ti, vi], 1).numpy()
    lat = rng.standard_normal((1, 48, t_lat, h, w)).astype(np.float32)
    ids = rng.integers(0, 4096, lu)
    noisy = [1, 2]
    mse = np.arange(lu + grid[1] * grid[2], lu + n_vis)
    ref_kw = dict(input_ids=torch.from_numpy(ids), text_indexes=torch.arange(lu), position_ids=torch.from_numpy(pos),
                  und_len=lu, sequence_length=lu + n_vis, vision_tokens=[torch.from_numpy(lat)],
                  vision_token_shapes=[grid], vision_sequence_indexes=torch.arange(lu, lu + n_vis),
                  vision_mse_loss_indexes=torch.from_numpy(mse), vision_timesteps=torch.full((len(mse),), 700.0),
                  vision_noisy_frame_indexes=[torch.tensor(noisy)])
    cu, su = mot.rope_tables(cfg, pos[:, :lu])
    cg, sg = mot.rope_tables(cfg, pos[:, lu:])
    noisy_tok = np.repeat(np.array([0, 1, 1], np.float32), grid[1] * grid[2])[None]
    args = [jnp.asarray(a) for a in (ids[None].astype(np.int32), cu[None], su[None])]
    patches = mot.patchify(cfg, jnp.asarray(lat[0].transpose(1, 2, 3, 0))[None])
    vis = [jnp.asarray(a) for a in (noisy_tok * 700.0, noisy_tok, cg[None], sg[None])]
    fwd = jax.jit(mot.vision_forward, static_argnums=1)
    tm = jnp.ones((1, lu), bool)

    def ours():  # the text pathway and the vision pathway: one full reference forward
        cache = mot.text_cache(state, cfg, *args)
        fwd(state, cfg, patches, vis[0], vis[1], vis[2], vis[3], cache, tm).block_until_ready()

    def ref_call():
        with torch.no_grad():
            ref(**ref_kw, return_dict=False)

    return dict(component="MoT forward (vs diffusers `Cosmos3OmniTransformer`)",
                config=f"4 layers, hidden 512, 4 heads (2 kv), text {lu} + vision {n_vis} tokens",
                vidax=ours, reference=ref_call)


def _shim():
    """diffusers resizes Cosmos' padding mask with torchvision (absent here): a NEAREST tensor resize
    is ``interpolate(mode="nearest")`` in torchvision."""
    import types

    import torch
    import diffusers.models.transformers.transformer_cosmos as tc

    if getattr(tc, "transforms", None) is None:
        fn = types.SimpleNamespace(resize=lambda img, size, interpolation=None: torch.nn.functional.interpolate(
            img, size=list(size), mode="nearest"))
        tc.transforms = types.SimpleNamespace(functional=fn, InterpolationMode=types.SimpleNamespace(NEAREST=0))


CASES = [predict25_dit, cosmos3_mot]
