"""HunyuanVideo benchmark cases (vidax vs diffusers, one forward each, timed as interleaved pairs
by the harness): the dual-/single-stream DiT and the causal VAE's decode."""
from __future__ import annotations


def dit_forward():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    from tests.refutil import perturb
    from vidax.models.hunyuanvideo import dit

    kw = dict(in_channels=16, out_channels=16, num_attention_heads=8, attention_head_dim=64, num_layers=2,
              num_single_layers=4, num_refiner_layers=2, text_embed_dim=4096, pooled_projection_dim=768,
              rope_axes_dim=(16, 24, 24))
    torch.manual_seed(0)
    ref = perturb(HunyuanVideoTransformer3DModel(**kw))
    cfg = dit.HunyuanVideoConfig.from_diffusers(dict(ref.config))
    folder = _save(ref)
    state, _ = dit.load_dit(folder, cfg)
    params = jax.device_put(state)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 8, 32, 32)).astype(np.float32)  # 8 x 16 x 16 = 2048 video tokens
    ctx = rng.standard_normal((1, 256, 4096)).astype(np.float32)
    mask = np.ones((1, 256), np.float32)
    mask[:, 200:] = 0
    pooled = rng.standard_normal((1, 768)).astype(np.float32)
    t, g = np.array([500.0], np.float32), np.array([6000.0], np.float32)
    fwd = jax.jit(dit.forward, static_argnums=1)
    args = (jnp.asarray(x.transpose(0, 2, 3, 4, 1)), jnp.asarray(t), jnp.asarray(ctx), jnp.asarray(mask), jnp.asarray(pooled),
            jnp.asarray(g))
    targs = {k: torch.from_numpy(v) for k, v in dict(hidden_states=x, timestep=t, encoder_hidden_states=ctx,
                                                      encoder_attention_mask=mask, pooled_projections=pooled,
                                                      guidance=g).items()}

    def vidax():
        jax.block_until_ready(fwd(params, cfg, *args))

    def reference():
        with torch.no_grad():
            ref(**targs, return_dict=False)

    D, M, lv, lt = cfg.dim, cfg.mlp_dim, 8 * 16 * 16, 256
    L = lv + lt
    double = 2 * L * (4 * D * D + 2 * D * M) + 4 * L * L * D  # both streams: q/k/v/o + MLP, joint attention
    single = 2 * L * (3 * D * D + D * M + (D + M) * D) + 4 * L * L * D
    refiner = cfg.num_refiner_layers * (2 * lt * (4 * D * D + 8 * D * D) + 4 * lt * lt * D) + 2 * lt * 4096 * D
    flops = cfg.num_layers * double + cfg.num_single_layers * single + refiner + 2 * lv * 64 * D
    return dict(component="DiT forward (vs diffusers `HunyuanVideoTransformer3DModel`)",
                config="2+4 blocks, dim 512, 8 heads, latents 8x32x32, text 256 (200 valid)", vidax=vidax,
                reference=reference, flops=flops)


def vae_decode():
    import numpy as np
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    from tests.refutil import perturb
    from vidax.models.hunyuanvideo import vae as hvae

    torch.manual_seed(0)
    ref = perturb(AutoencoderKLHunyuanVideo(latent_channels=16, block_out_channels=(32, 64, 64, 64), layers_per_block=2,
                                            norm_num_groups=32))
    vae = hvae.load_vae(_save(ref), hvae.HunyuanVAEConfig.from_diffusers(dict(ref.config)))
    z = np.random.default_rng(0).standard_normal((1, 16, 4, 16, 16)).astype(np.float32)

    def vidax():
        hvae.decode(vae, z)  # numpy out: blocks until done

    def reference():
        with torch.no_grad():
            ref.decode(torch.from_numpy(z))

    return dict(component="VAE decode (vs diffusers `AutoencoderKLHunyuanVideo`)",
                config="channels 32-64-64-64, z 16, latents 4x16x16 -> 13x128x128 px", vidax=vidax, reference=reference)


def vae_decode_real_width(latents: tuple = (2, 8, 8)):
    """The VAE decode at the released widths (channels 128-256-512-512, z 16, 2 resnets + 1 per
    decoder block): 2 latent frames at 8x8 -> 5 x 64 x 64 px, float32 both sides (seconds per decode
    on the 2-core CPU). ``vidax_lowered``: the decode program, lowered (``benchmarks.profile_wan_vae``)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    from tests.refutil import perturb
    from vidax.core import nn
    from vidax.models.hunyuanvideo import vae as hvae

    torch.manual_seed(0)
    ref = perturb(AutoencoderKLHunyuanVideo(latent_channels=16))
    vae = hvae.load_vae(_save(ref), hvae.HunyuanVAEConfig.from_diffusers(dict(ref.config)))
    f, h, w = latents
    z = np.random.default_rng(0).standard_normal((1, 16, f, h, w)).astype(np.float32)
    zt = torch.from_numpy(z)

    def vidax():
        hvae.decode(vae, z)  # numpy out: blocks until done

    def reference():
        with torch.no_grad():
            ref.decode(zt)

    def lowered():
        zz = jnp.asarray(z.transpose(0, 2, 3, 4, 1))
        return [nn._apply.lower(vae._graph, "decode_tile", (), vae.state, zz)]

    return dict(component="VAE decode (vs diffusers `AutoencoderKLHunyuanVideo`)",
                config=f"released widths: channels 128-256-512-512, z 16, latents {f}x{h}x{w} -> "
                       f"{(f - 1) * 4 + 1}x{8 * h}x{8 * w} px",
                vidax=vidax, reference=reference, vidax_lowered=lowered, hlo_module="_apply_pure")


def _save(model):
    import tempfile

    d = tempfile.mkdtemp(prefix="vidax-bench-hv-")
    model.save_pretrained(d)
    return d


CASES = [dit_forward, vae_decode, vae_decode_real_width]
