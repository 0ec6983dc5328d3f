"""HunyuanVideo 1.5 benchmark cases (vidax vs diffusers, one forward each, timed as interleaved
pairs by the harness): the DiT (image-to-video call: all three condition streams) and the VAE's
decode, at a small but realistic width."""
from __future__ import annotations


def dit_forward():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from tests.refutil import perturb
    from vidax.models.hunyuanvideo15 import dit

    kw = dict(in_channels=65, out_channels=32, num_attention_heads=8, attention_head_dim=64, num_layers=4,
              num_refiner_layers=2, text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
              rope_axes_dim=(16, 24, 24), task_type="i2v")
    torch.manual_seed(0)
    ref = perturb(HunyuanVideo15Transformer3DModel(**kw))
    state, cfg = dit.load_dit(_save(ref), dit.HunyuanVideo15Config.from_diffusers(dict(ref.config)))
    params = jax.device_put(state)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 65, 8, 16, 16)).astype(np.float32)  # 2048 video tokens (patch 1)
    ctx = rng.standard_normal((1, 256, 3584)).astype(np.float32)
    mask = np.zeros((1, 256), np.float32)
    mask[:, :200] = 1
    ctx2 = rng.standard_normal((1, 64, 1472)).astype(np.float32)
    mask2 = np.zeros((1, 64), np.float32)
    mask2[:, :20] = 1
    img = rng.standard_normal((1, 729, 1152)).astype(np.float32)
    t = np.array([500.0], np.float32)
    fwd = jax.jit(dit.forward, static_argnums=1)
    args = [jnp.asarray(a) for a in (x.transpose(0, 2, 3, 4, 1), t, ctx, mask, ctx2, mask2, img)]
    targs = {k: torch.from_numpy(v) for k, v in dict(
        hidden_states=x, timestep=t, encoder_hidden_states=ctx, encoder_attention_mask=mask,
        encoder_hidden_states_2=ctx2, encoder_attention_mask_2=mask2, image_embeds=img).items()}

    def vidax():
        jax.block_until_ready(fwd(params, cfg, *args))

    def reference():
        with torch.no_grad():
            ref(**targs, return_dict=False)

    D, M = cfg.dim, cfg.mlp_dim
    lv, lt = 8 * 16 * 16, 256 + 64 + 729
    L = lv + lt
    double = 2 * L * (4 * D * D + 2 * D * M) + 4 * L * L * D
    refiner = cfg.num_refiner_layers * (2 * 256 * 12 * D * D + 4 * 256 * 256 * D) + 2 * 256 * 3584 * D
    flops = cfg.num_layers * double + refiner + 2 * lv * 65 * D
    return dict(component="DiT forward, I2V (vs diffusers `HunyuanVideo15Transformer3DModel`)",
                config="4 blocks, dim 512, 8 heads, latents 8x16x16, text 256 (200 valid) + glyph 64 + image 729",
                vidax=vidax, reference=reference, flops=flops)


def _vae_case(latents: tuple, channels: tuple = (32, 64, 64, 128, 128), case: dict | None = None, **decode_kw):
    """(vidax, reference) callables decoding the same random latents of shape ``latents`` with one
    perturbed ``AutoencoderKLHunyuanVideo15`` (``channels``, z 32) on both sides. ``case``: a dict
    that receives ``vidax_lowered`` (the decode's level programs, lowered, for
    ``benchmarks.profile_wan_vae``)."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    from tests.refutil import perturb
    from vidax.models.hunyuanvideo15 import vae as hvae

    torch.manual_seed(0)
    ref = perturb(AutoencoderKLHunyuanVideo15(latent_channels=32, block_out_channels=channels, layers_per_block=2))
    vae = hvae.load_vae(_save(ref), hvae.HunyuanVideo15VAEConfig.from_diffusers(dict(ref.config)))
    z = np.random.default_rng(0).standard_normal(latents).astype(np.float32)

    def vidax():
        hvae.decode(vae, z, **decode_kw)  # numpy out: blocks until done

    def reference():
        with torch.no_grad():
            ref.decode(torch.from_numpy(z))

    if case is not None:
        def lowered():
            import jax

            from vidax.core import nn

            x, out = jax.device_put(np.ascontiguousarray(z.transpose(0, 2, 3, 4, 1))), []
            for i in range(len(channels) + 2):
                out.append(nn._apply.lower(vae._graph, "decode_level", (("level", i),), vae.state, x))
                x = vae.apply("decode_level", x, level=i)
            return out

        case["vidax_lowered"] = lowered
    return vidax, reference


def vae_decode():
    vidax, reference = _vae_case((1, 32, 4, 8, 8))
    return dict(component="VAE decode, staged (vs diffusers `AutoencoderKLHunyuanVideo15`)",
                config="channels 32-64-64-128-128, z 32, latents 4x8x8 -> 13x128x128 px", vidax=vidax,
                reference=reference)


def vae_decode_chunked():
    """The stages' decode: temporal chunks of 2 latent frames carrying the causal state, against
    the reference's all-frames decode of the same latents (same numerics, less memory per call)."""
    vidax, reference = _vae_case((1, 32, 6, 4, 8), chunk=2)
    return dict(component="VAE decode, temporal chunks of 2 latent frames (vs diffusers' all-frames decode)",
                config="channels 32-64-64-128-128, z 32, latents 6x4x8 -> 21x64x128 px", vidax=vidax,
                reference=reference)


def vae_decode_real_width(latents: tuple = (2, 4, 4)):
    """The decode at the released widths (channels 128-256-512-1024-1024, z 32, 16x spatial): 2
    latent frames at 4x4 -> 5 x 64 x 64 px (seconds per decode on the 2-core CPU)."""
    f, h, w = latents
    case = dict(hlo_module="_apply_pure")
    vidax, reference = _vae_case((1, 32, f, h, w), (128, 256, 512, 1024, 1024), case)
    return dict(case, component="VAE decode, staged (vs diffusers `AutoencoderKLHunyuanVideo15`)",
                config=f"released widths: channels 128-256-512-1024-1024, z 32, latents {f}x{h}x{w} -> "
                       f"{(f - 1) * 4 + 1}x{16 * h}x{16 * w} px", vidax=vidax, reference=reference)


def _save(model):
    import tempfile

    d = tempfile.mkdtemp(prefix="vidax-bench-hv15-")
    model.save_pretrained(d)
    return d


CASES = [dit_forward, vae_decode, vae_decode_chunked, vae_decode_real_width]
