"""Benchmark rows of the LTX family vs diffusers, same machine, same run: one forward each at a
small but realistic width. Every case returns ``dict(component, config, vidax, reference)``; both
callables block until done (``jax.block_until_ready`` / ``torch.no_grad``)."""
from __future__ import annotations

import warnings

import numpy as np


def _torch():
    import torch

    from tests.refutil import perturb

    return torch, perturb


def _loaded(ref, tmp_name):
    """The reference saved with save_pretrained and loaded through vidax.compat."""
    import tempfile

    from vidax import compat

    with tempfile.TemporaryDirectory(prefix=f"vidax-bench-{tmp_name}-") as d:  # (read whole: removed after)
        ref.save_pretrained(d)
        return compat.load_pretrained(d)


def bench_ltx_dit():
    import jax

    from diffusers import LTXVideoTransformer3DModel

    from vidax.models.ltx import dit

    torch, perturb = _torch()
    torch.manual_seed(0)
    ref = perturb(LTXVideoTransformer3DModel(num_attention_heads=8, attention_head_dim=64, cross_attention_dim=512,
                                             num_layers=4, caption_channels=1024))
    m = _loaded(ref, "ltx-dit")
    cfg = m.model_config
    f, h, w, lt = 8, 16, 24, 128
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, f * h * w, 128)).astype(np.float32)
    ctx = rng.standard_normal((1, lt, 1024)).astype(np.float32)
    mask = np.ones((1, lt), np.int64)
    mask[:, 100:] = 0
    cos, sin = dit.rope_tables(dit.video_coords(f, h, w, (8 / 25, 32, 32), cfg), cfg)
    inp = dit.model_inputs(cfg, x, np.array([500.0], np.float32), ctx, mask, cos, sin)
    fwd = jax.jit(dit.forward, static_argnums=1)
    tx = {k: torch.from_numpy(v) for k, v in dict(hidden_states=x, encoder_hidden_states=ctx,
                                                   timestep=np.array([500.0], np.float32), encoder_attention_mask=mask).items()}

    def run_vidax():
        jax.block_until_ready(fwd(m.params, cfg, inp))

    def run_ref():
        with torch.no_grad():
            ref(**tx, num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)

    return dict(component="LTX-Video DiT forward (vs diffusers LTXVideoTransformer3DModel)",
                config=f"4 blocks, dim 512, 8 heads, latents {f}x{h}x{w}, text {lt} (masked)", vidax=run_vidax,
                reference=run_ref)


def bench_ltx2_dit():
    import jax

    from diffusers import LTX2VideoTransformer3DModel

    from vidax.models.ltx import dit2

    torch, perturb = _torch()
    torch.manual_seed(0)
    ref = perturb(LTX2VideoTransformer3DModel(num_attention_heads=8, attention_head_dim=64, cross_attention_dim=512,
                                              audio_num_attention_heads=8, audio_attention_head_dim=32,
                                              audio_cross_attention_dim=256, num_layers=4, caption_channels=512,
                                              rope_type="split", gated_attn=True, audio_gated_attn=True,
                                              cross_attn_mod=True, audio_cross_attn_mod=True))
    m = _loaded(ref, "ltx2-dit")
    cfg = m.model_config
    f, h, w, la, lt = 8, 16, 24, 50, 128
    rng = np.random.default_rng(0)
    kw = dict(hidden_states=rng.standard_normal((1, f * h * w, 128)).astype(np.float32),
              audio_hidden_states=rng.standard_normal((1, la, 128)).astype(np.float32),
              encoder_hidden_states=rng.standard_normal((1, lt, 512)).astype(np.float32),
              audio_encoder_hidden_states=rng.standard_normal((1, lt, 512)).astype(np.float32),
              timestep=np.array([500.0], np.float32), sigma=np.array([500.0], np.float32))
    vc = dit2.video_coords(f, h, w, cfg, 24.0)
    ac = dit2.audio_coords(la, cfg)
    inp = dit2.model_inputs(cfg, kw["hidden_states"], kw["audio_hidden_states"], kw["encoder_hidden_states"],
                            kw["audio_encoder_hidden_states"], kw["timestep"], dit2.rope_tables(cfg, vc, ac),
                            sigma=kw["sigma"], use_cross_timestep=True)
    fwd = jax.jit(dit2.forward, static_argnums=1)
    tkw = {k: torch.from_numpy(v) for k, v in kw.items()}

    def run_vidax():
        jax.block_until_ready(fwd(m.params, cfg, inp))

    def run_ref():
        with torch.no_grad():
            ref(**tkw, num_frames=f, height=h, width=w, audio_num_frames=la, use_cross_timestep=True, return_dict=False)

    return dict(component="LTX-2 audio+video DiT forward (vs diffusers LTX2VideoTransformer3DModel)",
                config=f"4 blocks, video dim 512 / audio 256, split RoPE, gated, cross-attn AdaLN; "
                       f"video {f}x{h}x{w}, audio {la}, text {lt}", vidax=run_vidax, reference=run_ref)


def _vae_case(cls_name, kw, label, z_shape, temb=None, release=None):
    """A decode case: ``kw`` the diffusers config, or ``release`` (a shipped recipe, e.g.
    ``ltx2-t2v``) for its VAE at the released widths (its ``vae/config.json``)."""
    def case():
        import diffusers
        import jax

        torch, perturb = _torch()
        torch.manual_seed(0)
        cls = getattr(diffusers, cls_name)
        if release:
            from benchmarks.harness import shipped_config

            ref = perturb(cls.from_config(shipped_config(release)))
        else:
            ref = perturb(cls(**kw))
        m = _loaded(ref, cls_name)
        z = np.random.default_rng(0).standard_normal(z_shape).astype(np.float32)
        from vidax.models.ltx import vae as lvae

        zt = torch.from_numpy(z)
        t = None if temb is None else np.full((z_shape[0],), temb, np.float32)

        def run_vidax():
            jax.block_until_ready(lvae.decode(m.params, m.model_config, z, t))

        def run_ref():
            with torch.no_grad():
                ref.decode(zt, None if t is None else torch.from_numpy(t))

        def lowered():  # the decode program (benchmarks.profile_wan_vae)
            x = jax.numpy.asarray(z.transpose(0, 2, 3, 4, 1))
            tt = None if t is None else jax.numpy.asarray(t)
            return [lvae._decode.lower(m.params, m.model_config, lvae._has_encoder(m.params), x, tt, None)]

        return dict(component=f"{label} decode (vs diffusers {cls_name})",
                    config=f"latents {z_shape[2]}x{z_shape[3]}x{z_shape[4]} -> "
                           f"{(z_shape[2] - 1) * 8 + 1}x{z_shape[3] * 32}x{z_shape[4] * 32} px, "
                           + (f"released widths ({release})" if release else "narrow channels"),
                    vidax=run_vidax, reference=run_ref, vidax_lowered=lowered, hlo_module="_decode")

    case.__name__ = f"bench_{label.lower().replace(' ', '_').replace('-', '').replace('.', '')}"
    if release:
        case.__name__ = f"vae_decode_real_width_{release.replace('-', '_').replace('.', '')}"
        if z_shape[3:] != (2, 2):  # the module attribute's name, so --only tells the sizes apart
            case.__name__ += f"_{z_shape[3] * 32}px"
    return case


_V091 = dict(latent_channels=32, block_out_channels=(32, 64, 64, 64), decoder_block_out_channels=(32, 64, 128),
             layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(2, 2, 2, 2),
             decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
             upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True)
_V2 = dict(latent_channels=32, block_out_channels=(32, 64, 64, 64), decoder_block_out_channels=(32, 64, 128),
           layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(2, 2, 2, 2), decoder_causal=False,
           spatial_compression_ratio=32, temporal_compression_ratio=8)


def bench_audio(release: str | None = None):
    """The LTX-2 audio VAE decode + vocoder: narrow widths (base 64, vocoder 256), or ``release``'s
    (a shipped recipe's ``audio_vae`` / ``vocoder`` configs: base 128, vocoder 1024)."""
    import jax

    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from vidax.models.ltx import audio as laudio

    torch, perturb = _torch()
    torch.manual_seed(0)
    if release:
        from benchmarks.harness import shipped_config

        vae = perturb(AutoencoderKLLTX2Audio.from_config(shipped_config(release, "audio_vae")))
        voc = perturb(LTX2Vocoder.from_config(shipped_config(release, "vocoder")))
        widths = f"released widths ({release}: base {vae.config.base_channels}, vocoder {voc.config.hidden_channels})"
    else:
        vae = perturb(AutoencoderKLLTX2Audio(base_channels=64, ch_mult=(1, 2, 4), num_res_blocks=2, latent_channels=8,
                                             mel_bins=64))
        voc = perturb(LTX2Vocoder(in_channels=128, hidden_channels=256))
        widths = "vocoder width 256"
    mv, mc = _loaded(vae, "avae"), _loaded(voc, "voc")
    z = np.random.default_rng(0).standard_normal((1, 8, 50, 16)).astype(np.float32)
    zt = torch.from_numpy(z)

    def run_vidax():
        jax.block_until_ready(laudio.vocode(mc.split, laudio.decode_mel(mv.split, z)))

    def run_ref():
        with torch.no_grad():
            voc(vae.decode(zt).sample)

    return dict(component="LTX-2 audio VAE decode + vocoder (vs diffusers AutoencoderKLLTX2Audio + LTX2Vocoder)",
                config=f"latents 50x16 (2 s) -> mel 197x64 -> 2 x 47280 samples at 24 kHz; {widths}",
                vidax=run_vidax, reference=run_ref)


def bench_audio_real_width():
    """:func:`bench_audio` at the released widths (``ltx2-t2v``'s audio VAE and vocoder)."""
    return bench_audio("ltx2-t2v")


def bench_diffusion_decoder():
    import jax

    from diffusers import LTX2VideoDiffusionDecoderModel

    from vidax.models.ltx import diffusion_decoder as ldd

    torch, perturb = _torch()
    torch.manual_seed(0)
    ref = perturb(LTX2VideoDiffusionDecoderModel(
        latent_channels=32, decoder_head_dim=32, decoder_stage_channels=(256, 128, 64, 64, 32),
        decoder_stage_depths=(1, 1, 1, 1, 2), decoder_stage_kernels=((3, 5, 5), (3, 5, 5), (3, 3, 3), (3, 3, 3)),
        decoder_stage5_kernel=(5, 5, 5)))
    m = _loaded(ref, "dd")
    z = np.random.default_rng(0).standard_normal((1, 32, 2, 5, 5)).astype(np.float32)
    x_t = np.random.default_rng(1).standard_normal(ldd.pixel_shape(m.model_config, z.shape)).astype(np.float32)
    dec = ref.decoder

    def run_vidax():
        jax.block_until_ready(m.denoise(z, x_t, 1))

    def run_ref():
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            ctx = dec.forward_stage_4(dec.forward_stages_1_to_3(torch.from_numpy(z)))
            dec.denoise(ctx, torch.from_numpy(x_t), 1)

    return dict(component="LTX-2.5 diffusion decoder denoise (vs diffusers LTX2VideoDiffusionDecoderModel, flex attention)",
                config="stages 256/128/64/64/32, head dim 32, windows 3x5x5 .. 5^3, latents 2x5x5 -> 9x160x160 px",
                vidax=run_vidax, reference=run_ref)


# at the released widths (also by name, for ``benchmarks.profile_wan_vae --case ltx:NAME``)
vae_decode_real_width_ltx_video_09 = _vae_case("AutoencoderKLLTXVideo", None, "LTX-Video 0.9 VAE", (1, 128, 2, 2, 2),
                                               release="ltx-video-0.9")
vae_decode_real_width_ltx2_t2v = _vae_case("AutoencoderKLLTX2Video", None, "LTX-2 VAE", (1, 128, 2, 2, 2),
                                           release="ltx2-t2v")
# the same at 4x4 latents (9x128x128 px): at 2x2 the decode streams every weight for 4 latent pixels
# (memory-bound on both sides); here the convs' arithmetic counts, as at any real video size
vae_decode_real_width_ltx_video_09_128px = _vae_case("AutoencoderKLLTXVideo", None, "LTX-Video 0.9 VAE", (1, 128, 2, 4, 4),
                                                     release="ltx-video-0.9")
vae_decode_real_width_ltx2_t2v_128px = _vae_case("AutoencoderKLLTX2Video", None, "LTX-2 VAE", (1, 128, 2, 4, 4),
                                                 release="ltx2-t2v")
# and at 8x8 latents (9x256x256 px): frames where the convs' arithmetic counts more still
vae_decode_real_width_ltx_video_09_256px = _vae_case("AutoencoderKLLTXVideo", None, "LTX-Video 0.9 VAE", (1, 128, 2, 8, 8),
                                                     release="ltx-video-0.9")
vae_decode_real_width_ltx2_t2v_256px = _vae_case("AutoencoderKLLTX2Video", None, "LTX-2 VAE", (1, 128, 2, 8, 8),
                                                 release="ltx2-t2v")
CASES = [bench_ltx_dit, bench_ltx2_dit,
         _vae_case("AutoencoderKLLTXVideo", _V091, "LTX-Video 0.9.1 VAE", (1, 32, 3, 4, 6), temb=0.05),
         _vae_case("AutoencoderKLLTX2Video", _V2, "LTX-2 VAE", (1, 32, 3, 4, 6)),
         vae_decode_real_width_ltx_video_09, vae_decode_real_width_ltx2_t2v, vae_decode_real_width_ltx_video_09_128px,
         vae_decode_real_width_ltx2_t2v_128px, vae_decode_real_width_ltx_video_09_256px,
         vae_decode_real_width_ltx2_t2v_256px, bench_audio, bench_audio_real_width,
         bench_diffusion_decoder]
