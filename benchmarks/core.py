"""Benchmark cases for the shared components and Wan, at the real widths of the released models.

Each case returns ``dict(component, config, vidax, reference, flops=None)``: two callables that
each run one forward and block until it is done (see ``benchmarks.harness.paired``).
"""
from __future__ import annotations

import numpy as np


def dit_1p3b():
    """Wan DiT forward at the 1.3B head size and FFN ratio (dim 1536, 12 heads of 128, FFN 8960),
    2 blocks, 2048 video + 512 text tokens, vs diffusers' WanTransformer3DModel."""
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import WanTransformer3DModel

    from tests.refutil import perturb
    from vidax.core import nn
    from vidax.models.wan import dit
    from vidax.weights import load_params

    heads, hd, layers, ffn, text_dim, lt = 12, 128, 2, 8960, 4096, 512
    f, h, w = 8, 32, 32  # 8 x 16 x 16 = 2048 tokens
    ref = perturb(WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=hd, in_channels=16,
                                        out_channels=16, text_dim=text_dim, ffn_dim=ffn, num_layers=layers))
    cfg = dit.WanDiTConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    params = jax.device_put(nn.fill(dit.abstract_state(cfg), load_params(sd, dit.diffusers_keymap(cfg),
                                                                          dit.param_shapes(cfg))))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, f, h, w)).astype(np.float32)
    ctx = rng.standard_normal((1, lt, text_dim)).astype(np.float32)
    t = np.array([500.0], np.float32)
    fwd = jax.jit(dit.forward, static_argnums=1)
    xj, cj, tj = jnp.asarray(x.transpose(0, 2, 3, 4, 1)), jnp.asarray(ctx), jnp.asarray(t)
    xt, ct, tt = torch.from_numpy(x), torch.from_numpy(ctx), torch.from_numpy(t)

    def reference():
        with torch.no_grad():
            ref(hidden_states=xt, timestep=tt, encoder_hidden_states=ct, return_dict=False)

    vidax = lambda: fwd(params, cfg, xj, tj, cj).block_until_ready()  # noqa: E731
    # counted by hand: XLA's cost analysis counts the body of the query-blocked attention's scan once
    D, L, F = heads * hd, f * h * w // 4, ffn
    block = (4 * 2 * L * D * D + 4 * L * L * D  # self-attention: q/k/v/o, scores and values
             + 2 * 2 * L * D * D + 2 * 2 * lt * D * D + 4 * L * lt * D  # cross-attention
             + 2 * 2 * L * D * F)  # feed-forward
    flops = layers * block + 2 * lt * (text_dim * D + D * D) + 2 * L * 64 * D * 2
    return dict(component="DiT forward (vs diffusers WanTransformer3DModel)",
                config=f"1.3B widths: dim 1536, 12x128 heads, FFN 8960, {layers} blocks, 2048 video + {lt} text tokens",
                vidax=vidax, reference=reference, flops=flops)


def umt5_xxl():
    """UMT5-XXL encoder layers at their real width (d_model 4096, 64 heads, FFN 10240), 2 layers,
    512 tokens (200 real), vs transformers' UMT5EncoderModel."""
    import jax.numpy as jnp
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    from tests.refutil import perturb
    from vidax.text import t5

    hc = UMT5Config(vocab_size=4096, d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64,
                    feed_forward_proj="gated-gelu", dropout_rate=0.0)
    ref = perturb(UMT5EncoderModel(hc))
    cfg = t5.T5Config.from_hf(hc.to_dict())
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    enc = t5.from_params(cfg, t5.load_params_from(sd, cfg))
    L = 512
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 4096, (1, L)).astype(np.int64)
    mask = np.zeros((1, L), np.int64)
    mask[:, :200] = 1
    ij, mj = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    it, mt = torch.from_numpy(ids), torch.from_numpy(mask)

    def reference():
        with torch.no_grad():
            ref(input_ids=it, attention_mask=mt)

    d, inner, ff = 4096, 64 * 64, 10240
    flops = 2 * (2 * L * d * inner * 4 + 4 * L * L * inner + 2 * L * d * ff * 3)
    return dict(component="Text encode (vs transformers UMT5EncoderModel)",
                config=f"UMT5-XXL widths: d_model 4096, 64 heads, FFN 10240, 2 layers, {L} tokens",
                vidax=lambda: enc(ij, mj).block_until_ready(), reference=reference, flops=flops)


def offload_chunk1():
    """The DiT with its blocks streamed from host memory one block at a time vs resident (both
    vidax, same process): the cost of offloading's bookkeeping and transfers on this machine."""
    import jax
    import jax.numpy as jnp

    from vidax.models.wan import dit

    cfg = dit.WanDiTConfig(num_heads=8, head_dim=64, text_dim=512, freq_dim=64, ffn_dim=2048, num_layers=8)
    state = dit.init_state(cfg, seed=0)
    resident = dit.WanDiTRunner(state, cfg)
    offloaded = dit.WanDiTRunner(state, cfg, offload_chunk_size=1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 4, 32, 32, 16)).astype(np.float32))
    ctx = jnp.asarray(rng.standard_normal((1, 128, 512)).astype(np.float32))
    t = jnp.asarray([500.0], jnp.float32)
    return dict(component="Offload chunk=1 (vs the same DiT resident)",
                config="8 blocks, dim 512, 8 heads, FFN 2048, 1024 video + 128 text tokens",
                vidax=lambda: jax.block_until_ready(offloaded(x, t, ctx)),
                reference=lambda: jax.block_until_ready(resident(x, t, ctx)), flops=None)


CASES = [dit_1p3b, umt5_xxl, offload_chunk1]


def vae_decode_real_width(conv_impl=None):
    """Wan2.1 VAE decode at the released widths (base_dim 96, z 16): 2 latent frames at 16x16 ->
    5 x 128 x 128 pixels, vs diffusers' AutoencoderKLWan. ``conv_impl``: vidax's (None: its default).
    ``vidax_lowered`` gives the two chunk programs (first, later) lowered, for their optimized HLO."""
    import jax
    import torch
    from diffusers import AutoencoderKLWan

    from tests.refutil import perturb
    from vidax.models.wan import vae
    from vidax.weights import load_params

    ref = perturb(AutoencoderKLWan(base_dim=96, z_dim=16))
    cfg = vae.WanVAEConfig.from_diffusers(dict(ref.config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    state = jax.device_put(vae.state_from_pure(cfg, load_params(sd, vae.diffusers_keymap(cfg), vae.param_shapes(cfg))))
    z = np.random.default_rng(0).standard_normal((1, 16, 2, 16, 16)).astype(np.float32)
    zt = torch.from_numpy(z)

    def reference():
        with torch.no_grad():
            ref.decode(zt, return_dict=False)

    def lowered():
        impl = vae._conv_impl(conv_impl)
        kw = dict(cfg=cfg, attn_impl=None, conv_impl=impl)
        _, cache = vae.decode(state, cfg, z, stop=1, return_cache=True, conv_impl=conv_impl)
        return [vae.decode_chunk_jit.lower(state, jax.device_put(z[:, :, :1]), None, first=True, **kw),
                vae.decode_chunk_jit.lower(state, jax.device_put(z[:, :, 1:2]), cache, first=False, **kw)]

    return dict(component="VAE decode (vs diffusers AutoencoderKLWan)",
                config="Wan2.1 widths: base_dim 96, z 16, latents 2x16x16 -> 5x128x128 px",
                vidax=lambda: np.asarray(vae.decode(state, cfg, z, conv_impl=conv_impl)), reference=reference,
                flops=None, vidax_lowered=lowered, vidax_inputs=(state, cfg, z))


CASES.append(vae_decode_real_width)
