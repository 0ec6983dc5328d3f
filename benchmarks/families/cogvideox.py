"""CogVideoX benchmark cases: vidax vs diffusers, one forward each at a realistic-but-small width.

Each case returns ``dict(component, config, vidax, reference)``; both callables block until done.
"""
from __future__ import annotations

import numpy as np


def _perturbed(module, seed):
    from tests.refutil import perturb

    return perturb(module, seed=seed)


def dit_forward():
    """CogVideoX-5B-shaped DiT (rotary, joint text+video attention): 4 blocks, dim 512."""
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import CogVideoXTransformer3DModel

    from vidax.core import nn
    from vidax.models.cogvideox import dit
    from vidax.weights import load_params

    heads, hd, layers, text_dim, lt = 8, 64, 4, 4096, 226
    f, h, w = 4, 32, 32
    ref = _perturbed(CogVideoXTransformer3DModel(num_attention_heads=heads, attention_head_dim=hd, num_layers=layers,
                                                 text_embed_dim=text_dim, use_rotary_positional_embeddings=True,
                                                 sample_height=h, sample_width=w, sample_frames=(f - 1) * 4 + 1), 0)
    cfg = dit.CogVideoXConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    params = jax.device_put(nn.fill(dit.abstract_state(cfg), load_params(sd, dit.diffusers_keymap(cfg),
                                                                          dit.param_shapes(cfg))))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, f, 16, h, w)).astype(np.float32)
    ctx = rng.standard_normal((1, lt, text_dim)).astype(np.float32)
    t = np.array([500], np.int64)
    rope = dit.rope_tables(cfg, (f, h // 2, w // 2))
    fwd = jax.jit(dit.forward, static_argnums=1)
    xj, cj, tj = jnp.asarray(x.transpose(0, 1, 3, 4, 2)), jnp.asarray(ctx), jnp.asarray(t, jnp.float32)
    rj = tuple(jnp.asarray(a) for a in rope)
    xt, ct, tt = torch.from_numpy(x), torch.from_numpy(ctx), torch.from_numpy(t)
    rt = tuple(torch.from_numpy(a) for a in rope)

    def run_ref():
        with torch.no_grad():
            ref(hidden_states=xt, encoder_hidden_states=ct, timestep=tt, image_rotary_emb=rt, return_dict=False)

    return dict(component="DiT forward (vs diffusers `CogVideoXTransformer3DModel`)",
                config=f"{layers} blocks, dim {heads * hd}, {heads} heads, latents {f}x{h}x{w}, text {lt} (joint)",
                vidax=lambda: fwd(params, cfg, xj, tj, cj, None, rj).block_until_ready(), reference=run_ref)


def _vae_case(cfg: dict, latents: tuple, config: str, **kw):
    import torch
    from diffusers import AutoencoderKLCogVideoX

    from vidax import compat

    ref = _perturbed(AutoencoderKLCogVideoX(**cfg), 1)
    import tempfile

    folder = tempfile.mkdtemp(prefix="vidax-bench-cogvae-")
    ref.save_pretrained(folder)
    ours = compat.load_pretrained(folder)
    z = np.random.default_rng(0).standard_normal(latents).astype(np.float32)
    zt = torch.from_numpy(z)

    def run_ref():
        with torch.no_grad():
            ref.decode(zt)

    def lowered():  # the decode's frame-batch programs (first, later), for benchmarks.profile_wan_vae
        import jax

        from vidax.core import conv as vconv
        from vidax.core import nn
        from vidax.models.cogvideox import vae as cvae

        vae, out, cache = ours.vae, [], None
        for a, b in cvae.decode_batches(z.shape[2]):
            zz = jax.device_put(z[:, :, a:b])
            out.append(nn._apply.lower(vae._graph, "decode_batch", (("conv_impl", vconv.conv_impl(None)),),
                                       vae.state, zz, cache))
            cache = vae.decode_batch(zz, cache)[1]
        return out

    return dict(component="VAE decode (vs diffusers `AutoencoderKLCogVideoX`)", config=config,
                vidax=lambda: ours.decode(z, **kw), reference=run_ref, vidax_lowered=lowered, hlo_module="_apply_pure")


def vae_decode():
    """CogVideoX VAE decode through its frame batches (3 + 2 latent frames -> 17 frames), narrow."""
    return _vae_case(dict(block_out_channels=(32, 64, 64, 64), latent_channels=16, layers_per_block=1,
                          norm_num_groups=8), (1, 16, 5, 16, 16),
                     "block_out_channels 32-64, z 16, latents 5x16x16 -> 17x128x128 px")


def vae_decode_real_width(**kw):
    """The CogVideoX 2B/5B VAE's widths (block_out_channels 128-256-256-512, 3 resnets per block,
    32 groups), 3 latent frames at 8x8 -> 9 x 64 x 64 pixels."""
    return _vae_case(dict(block_out_channels=(128, 256, 256, 512), latent_channels=16, layers_per_block=3,
                          norm_num_groups=32), (1, 16, 3, 8, 8),
                     "CogVideoX widths: channels 128-256-256-512, z 16, latents 3x8x8 -> 9x64x64 px", **kw)


CASES = [dit_forward, vae_decode, vae_decode_real_width]
