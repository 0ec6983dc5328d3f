"""The LTX-2.x pipelines on the vidax protocol: audio + video, Gemma 3 through the text connectors
(sources, phases and tiled decode: :mod:`vidax.models.ltx.common`)."""
from __future__ import annotations

import functools

import re
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from vidax.models.ltx import audio as laudio
from vidax.models.ltx import connectors as lconn
from vidax.models.ltx import dit2 as ldit2
from vidax.models.ltx import vae as lvae
from vidax.models.ltx.common import (EMB, LATENT, NOISE_AUDIO, NOISE_DECODE, NOISE_LATENTS, NOISE_VAE, ProbeVAE, Source,
                                     Tiles, check_prompt_lengths, default_request, first_frame_mask, key_for,
                                     make_scheduler, pack, preset_stats, replicated, resize_image, unpack, with_image)
from vidax.models.ltx.sampling import sample_av
from vidax.pipeline import DecodeSpan, Geometry, Named, Option, OptionError, Pipeline, to_uint8, to_unit_range
from vidax.text.tokenizer import ByteTokenizer, load_tokenizer
from vidax.weights.keymap import lazy_params


def _tiny_gemma():
    from vidax.text import lm

    return lm.LMConfig.from_hf({"model_type": "gemma3_text", "vocab_size": 384, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 8,
                                "query_pre_attn_scalar": 16, "sliding_window_pattern": 2})


@dataclass(frozen=True)
class LTX2Preset:
    """A seeded random-weight LTX-2-shaped model: Gemma 3 (3 layers), connectors with registers,
    an audio+video DiT, LTX-2 video VAE, audio VAE + vocoder (8 kHz), a diffusion decoder."""

    dit: ldit2.LTX2DiTConfig = field(default_factory=lambda: ldit2.LTX2DiTConfig(
        in_channels=8, out_channels=8, num_heads=2, head_dim=8, cross_attention_dim=16, audio_in_channels=16,
        audio_out_channels=16, audio_num_heads=2, audio_head_dim=6, audio_cross_attention_dim=12, num_layers=2,
        caption_channels=32, rope_type="split", perturbed_attn=True))
    connectors: lconn.ConnectorsConfig = field(default_factory=lambda: lconn.ConnectorsConfig(
        caption_channels=32, text_proj_in_factor=4, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=16, video_connector_num_layers=1, video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=16, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8, rope_type="split"))
    vae: lvae.LTXVAEConfig = field(default_factory=lambda: replace(
        lvae.V2_DEFAULTS, latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), decoder_causal=False))
    audio_vae: laudio.AudioVAEConfig = field(default_factory=lambda: laudio.AudioVAEConfig(
        base_channels=16, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4, mel_bins=16, resolution=16))
    vocoder: laudio.VocoderConfig = field(default_factory=lambda: laudio.VocoderConfig(
        in_channels=32, hidden_channels=16, upsample_kernel_sizes=(7, 4, 4), upsample_factors=(5, 4, 4),
        resnet_kernel_sizes=(3,), resnet_dilations=((1, 3),), output_sampling_rate=8000))
    max_text_len: int = 256  # byte tokens: a 20-word prompt fits
    seed: int = 0


LTX2_PRESETS = {"tiny": LTX2Preset()}

#: the reference's STG block (LTX-2's 48-block DiT)
_STG_DEFAULT = "28"

def apply_crf(image_uint8: np.ndarray, crf: int) -> np.ndarray:
    """Re-compress one RGB image as a 1-frame H.264 video at ``crf`` (libx264, veryfast, yuv420p),
    as the LTX-2 image-to-video pipeline does before encoding it; ``crf=0`` returns it unchanged.
    Dimensions are cut to even sizes first, as the reference does."""
    if not crf:
        return image_uint8
    import os
    import tempfile

    import imageio.v2 as iio2

    img = np.asarray(image_uint8, np.uint8)
    img = img[: img.shape[0] // 2 * 2, : img.shape[1] // 2 * 2]
    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="vidax-crf-")
    os.close(fd)
    try:
        w = iio2.get_writer(path, fps=1, codec="libx264", quality=None, macro_block_size=1, pixelformat="yuv420p",
                            ffmpeg_params=["-crf", str(int(crf)), "-preset", "veryfast"], ffmpeg_log_level="error")
        w.append_data(img)
        w.close()
        r = iio2.get_reader(path)
        out = np.asarray(r.get_data(0))
        r.close()
    finally:
        os.remove(path)
    return out


class LTX2(ProbeVAE, Source, Tiles, Pipeline):
    """LTX-2.x audio + video (``LTX2Pipeline``; with ``image_to_video`` or an
    ``LTX2ImageToVideoPipeline`` folder, image-to-video). LTX-2.5 checkpoints load through the same
    class (their DiT / connector switches come from the configs)."""

    FAMILY = "ltx"
    GUIDANCE = "cfg"
    OUTPUTS = ("video", "audio")
    STEP_CACHE = True
    OPTIONS = (
        Option("audio", bool, True, "write the sound track (sampling always runs both streams)", stages=("mux",)),
        Option("audio_guidance", float, 7.0, "classifier-free guidance of the audio stream", minimum=0.0, maximum=100.0),
        Option("stg_scale", float, 1.0, "spatio-temporal guidance (video)", minimum=0.0, maximum=100.0),
        Option("audio_stg_scale", float, 1.0, "spatio-temporal guidance (audio)", minimum=0.0, maximum=100.0),
        Option("stg_blocks", str, _STG_DEFAULT, "blocks whose self-attention spatio-temporal guidance skips (comma list)"),
        Option("modality_scale", float, 3.0, "modality-isolation guidance (video)", minimum=0.0, maximum=100.0),
        Option("audio_modality_scale", float, 3.0, "modality-isolation guidance (audio)", minimum=0.0, maximum=100.0),
        Option("guidance_rescale", float, 0.7, "guidance rescale (video)", minimum=0.0, maximum=1.0),
        Option("audio_guidance_rescale", float, 0.7, "guidance rescale (audio)", minimum=0.0, maximum=1.0),
        Option("use_cross_timestep", bool, True, "cross-modal modulation from the other stream's sigma (LTX-2.3+)"),
        Option("decode_timestep", float, 0.0, "timestep-conditioned VAE decoders: the decode timestep",
               minimum=0.0, maximum=1.0, stages=("decode:video",)),
        Option("decode_noise_scale", float, None, "noise mixed into the latents before a timestep-conditioned decode "
               "(default: decode_timestep)", minimum=0.0, maximum=1.0, stages=("decode:video",)),
        Option("vae_tiling", bool, True, "decode the video in spatial tiles, one persisted stage each (512 px tiles, "
               "448 px stride, as the reference's enable_tiling)", stages=("decode",)),
        Option("vae_decoder", str, "vae", "video decoder: the convolutional VAE, or LTX-2.5's diffusion decoder",
               choices=("vae", "diffusion"), stages=("decode",)),
        Option("decoder_steps", int, None, "diffusion decoder steps (default: its config)", minimum=1, maximum=50,
               stages=("decode:video",)),
        Option("image_crf", int, 33, "H.264 CRF the conditioning image is re-compressed with (0: none)",
               minimum=0, maximum=51, stages=("encode",)),
    )
    COMPONENTS = {"encode": ("text",), "image": ("vae",), "sample": ("dit",), "decode": ("vae", "audio")}
    CODE_DEPS = ("vidax.text",)

    def __init__(self, source="tiny", *, dtype=np.float32, mesh=None, parallelism=None, offload_chunk_size=None,
                 prefetch: bool = True, image_to_video: bool | None = None):
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism, self.offload_chunk_size, self.prefetch = mesh, parallelism, offload_chunk_size, prefetch
        self._init_source(source, LTX2_PRESETS)
        cls = self.index.get("_class_name", "LTX2Pipeline")
        self.image_to_video = cls == "LTX2ImageToVideoPipeline" if image_to_video is None else bool(image_to_video)

    # ------------------------------------------------------------------ configs
    @property
    def max_text_len(self) -> int:
        return self.preset.max_text_len if self.preset else 1024

    def dit_config(self) -> ldit2.LTX2DiTConfig:
        return self.preset.dit if self.preset else ldit2.LTX2DiTConfig.from_diffusers(self._config("transformer"))

    def vae_config(self) -> lvae.LTXVAEConfig:
        return self.preset.vae if self.preset else lvae.LTXVAEConfig.from_diffusers(self._config("vae"))

    def audio_vae_config(self) -> laudio.AudioVAEConfig:
        return self.preset.audio_vae if self.preset else laudio.AudioVAEConfig.from_diffusers(self._config("audio_vae"))

    def geometry(self) -> Geometry:
        d, v = self.dit_config(), self.vae_config()
        return Geometry(spatial=v.spatial_ratio, temporal=v.temporal_ratio, latent_channels=d.out_channels,
                        patch=(d.patch_size_t, d.patch_size, d.patch_size), num_heads=d.num_heads)

    def weight_loaders(self, request) -> list:
        enc = getattr(request, "image", None) is not None or self.image_to_video
        out = [("text encoder", self.load_text_encoder), ("text connectors", self.load_connectors),
               ("DiT", lambda: ldit2.load_dit(self.folder / "transformer", self.dit_config(), dtype=self.dtype)),
               ("VAE", lambda: self.load_vae(encoder=enc)),
               ("audio VAE", lambda: laudio.load_vae(self.folder / "audio_vae")),
               ("vocoder", lambda: laudio.load_vocoder(self.folder / "vocoder"))]
        if request.options.get("vae_decoder") == "diffusion":
            out.append(("diffusion decoder", self.load_diffusion_decoder))
        return out

    def check(self, request) -> None:
        self._check_stg_blocks(request.options.get("stg_blocks"))  # configs only (as geometry())
        if request.options.get("vae_decoder") == "diffusion" and not self.has_diffusion_decoder:
            raise OptionError("vae_decoder", f"{self.source}: this checkpoint has no diffusion_decoder/")
        if self.preset is None and self._folder is None:
            return
        if self.folder is not None:
            need = ["text_encoder", "tokenizer", "connectors", "transformer", "vae", "audio_vae", "vocoder", "scheduler"]
            missing = [n for n in need if not (self.folder / n).is_dir()]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {', '.join(missing)}/ (diffusers layout)")
        check_prompt_lengths(self.load_tokenizer(), request, self.max_text_len)

    def _check_stg_blocks(self, value) -> None:
        """``stg_blocks``: a comma list of block indices within the DiT's depth. The declared
        default (the reference's block 28) is let through on a shallower DiT (the tiny preset),
        where it skips no block, as before; any other value out of range is refused."""
        if value is None:
            return
        depth = self.dit_config().num_layers
        parts = [s.strip() for s in str(value).split(",")]
        ok = bool(parts) and all(re.fullmatch(r"\d+", s) for s in parts)
        blocks = [int(s) for s in parts] if ok else []
        if ok and all(b < depth for b in blocks):
            return
        if ok and value == _STG_DEFAULT:
            return
        raise OptionError("stg_blocks", f"{value!r}: give a comma list of DiT block indices between 0 and "
                                        f"{depth - 1} (this DiT has {depth} blocks), e.g. {min(depth - 1, 28)}")

    @property
    def has_diffusion_decoder(self) -> bool:
        if self.preset is not None:
            return True
        return (self.config_folder / "diffusion_decoder" / "config.json").exists()

    def stage_params(self, kind, request, span=None):
        p = super().stage_params(kind, request, span)
        if kind == "sample":
            p["fps"] = request.fps  # the rotary time coordinates are in seconds
        return p

    # ------------------------------------------------------------------ components
    def load_tokenizer(self):
        if self.preset:
            return ByteTokenizer()
        return load_tokenizer(self.folder / "tokenizer")

    def tokenize(self, tok, prompts):
        """Left-padded ids and mask [B, max_text_len] (the reference pads on the left)."""
        prompts = [p.strip() for p in prompts]
        if isinstance(tok, ByteTokenizer):
            ids, mask = tok(prompts, self.max_text_len)
            n = mask.sum(axis=1)
            return (np.stack([np.roll(r, self.max_text_len - k) for r, k in zip(ids, n)]),
                    np.stack([np.roll(r, self.max_text_len - k) for r, k in zip(mask, n)]))
        return tok(prompts, self.max_text_len, padding_side="left", add_special_tokens=True)

    def load_text_encoder(self):
        from vidax.text import lm

        if self.preset:
            return lm.init(_tiny_gemma(), seed=self.preset.seed + 1)
        # Gemma 3 12B in float32 is ~48 GB: its heads / MLP / vocabulary split over the encode slice (tp)
        return lm.load_lm(self.folder / "text_encoder", dtype=np.float32, mesh=self.text_mesh())

    def load_connectors(self):
        if self.preset:
            return lconn.init(self.preset.connectors, seed=self.preset.seed + 5)
        with self.lora_merging("connectors"):  # a LoRA's connector keys, merged in float32
            return lconn.load(self.folder / "connectors")

    def lora_targets(self) -> dict:
        from vidax.models.ltx import lora as llora

        out = self.transformer_lora_targets(llora.aliases2(self.dit_config()), "this LTX-2 DiT (transformer)")
        if out:  # the text connectors (encode stage) take a LoRA's connector keys, as diffusers' loader does
            out["connectors"] = llora.connectors_target(self.folder / "connectors")
        return out

    def load_dit(self):
        cfg = self.dit_config()
        if self.preset:
            state = ldit2.init_state(cfg, seed=self.preset.seed + 2, dtype=self.dtype)
        else:
            with self.lora_merging("dit"), lazy_params(self.mesh is not None and self.offload_chunk_size is None):
                state, cfg = ldit2.load_dit(self.folder / "transformer", cfg, dtype=self.dtype)
        if self.mesh is None and self.offload_chunk_size is None and self.step_cache is None:
            return jax.device_put(state), cfg
        return ldit2.runner(state, cfg, self.mesh, self.parallelism, offload_chunk_size=self.offload_chunk_size,
                            prefetch=self.prefetch), cfg

    def load_vae(self, encoder: bool = False):
        cfg = self.vae_config()
        if self.preset:
            return jax.device_put(lvae.init_state(cfg, seed=self.preset.seed + 3)), cfg, preset_stats(cfg, self.preset.seed + 3)
        state, cfg, stats = lvae.load_vae(self.folder / "vae", cfg, encoder=encoder)
        return jax.device_put(state), cfg, stats

    def load_audio(self):
        """(audio VAE decoder, its stats, vocoder)."""
        if self.preset:
            cfg = self.preset.audio_vae
            rng = np.random.default_rng(self.preset.seed + 6)
            c = cfg.base_channels
            stats = {"latents_mean": (0.1 * rng.standard_normal(c)).astype(np.float32),
                     "latents_std": (1.0 + 0.1 * rng.uniform(-1, 1, c)).astype(np.float32)}
            return (laudio.init_vae(cfg, self.preset.seed + 6, encoder=False), stats,
                    laudio.init_vocoder(self.preset.vocoder, self.preset.seed + 7))
        vae, _, stats = laudio.load_vae(self.folder / "audio_vae")
        return vae, stats, laudio.load_vocoder(self.folder / "vocoder")

    def load_diffusion_decoder(self):
        from vidax.models.ltx import diffusion_decoder as ldd

        if self.preset:
            cfg = ldd.PRESETS["tiny"]
            return ldd.init(cfg, self.preset.seed + 8), cfg, preset_stats(self.preset.vae, self.preset.seed + 3)
        return ldd.load(self.folder / "diffusion_decoder")

    def audio_sample_rate(self) -> int:
        if self.preset:
            return self.preset.vocoder.output_sampling_rate
        return laudio.vocoder_config(self._config("vocoder")).output_sampling_rate

    def plan_units(self, request) -> list:
        """Gemma 3's every-layer hidden states (float32, over tp as :meth:`load_text_encoder` shards
        it over the encode slice) and the text connectors; one DiT call on a guidance group (2B with
        CFG: video and audio streams together) on this pipeline's mesh; the video VAE's decode stage
        (one spatial tile with ``vae_tiling``), the audio VAE and the vocoder."""
        from flax import nnx

        from vidax.core import nn
        from vidax.core import plan as vplan
        from vidax.text import lm

        b, n = len(request.prompts), self.max_text_len
        tcfg = _tiny_gemma() if self.preset else lm.LMConfig.from_hf(self._config("text_encoder"))
        enc = lm.abstract(tcfg, np.float32)
        tp = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoder splits it
        enc = lm.shard(enc, f"tp={tp}") if tp > 1 else enc
        ids = vplan.abstract((b, n), np.int32)
        ccfg = self.preset.connectors if self.preset else lconn.ConnectorsConfig.from_diffusers(self._config("connectors"))
        conn = nn.Split(*nn.abstract_state(lambda: lconn._build(ccfg)), ccfg)
        hs = vplan.abstract((b, n, tcfg.hidden_size, tcfg.num_layers + 1), np.float32)
        units = [vplan.split_unit("encode", "Gemma 3 text encoder (all layers)", enc, ids, ids, None,
                                  method="hidden_states", note=f"{b} prompt(s) x {n} tokens"),
                 vplan.split_unit("encode", "text connectors", conn, hs, ids, padding_side="left")]
        v, a, m = jax.eval_shape(lambda s, h, k: nnx.merge(conn.graphdef, s)(h, k, "left"), conn.state, hs, ids)
        cfg = self.dit_config()
        runner = ldit2.runner(ldit2.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        ag = request.options.get("audio_guidance")
        use_cfg = request.guidance > 1.0 or float(7.0 if ag is None else ag) > 1.0
        nb = 2 * b if use_cfg else b
        grid = self.latent_grid(request.height, request.width, request.num_frames)
        p, pt = cfg.patch_size, cfg.patch_size_t
        tg = (grid[0] // pt, grid[1] // p, grid[2] // p)
        s, la, fps = tg[0] * tg[1] * tg[2], self.audio_frames(request.num_frames,
                                                              float(request.fps or 24)), float(request.fps or 24)
        ropes = vplan.like(ldit2.rope_tables(cfg, ldit2.video_coords(*tg, cfg, fps), ldit2.audio_coords(la, cfg)))
        stg = tuple(int(x) for x in str(request.options.get("stg_blocks") or "28").split(",")
                    if x.strip() and int(x) < cfg.num_layers)
        vec = vplan.abstract((nb,), np.float32)

        def inputs(vtok, atok, ctx, actx, vt, ropes, tb, mask):
            return ldit2.model_inputs(cfg, vtok, atok, ctx, actx, vt, ropes, ta=tb, sigma=tb, mask=mask, amask=mask,
                                      use_cross_timestep=bool(request.options.get("use_cross_timestep", True)),
                                      perturb=tb, stg_blocks=stg, isolate=tb)

        inp = jax.eval_shape(inputs, vplan.abstract((nb, s, cfg.in_channels * pt * p * p), self.dtype),
                             vplan.abstract((nb, la, cfg.audio_in_channels), self.dtype),
                             vplan.abstract((nb, n, v.shape[-1]), self.dtype), vplan.abstract((nb, n, a.shape[-1]), self.dtype),
                             vplan.abstract((nb, s), np.float32) if self.image_to_video else vec, ropes, vec,
                             vplan.abstract((nb, n), np.float32))
        units.append(vplan.Unit("sample", "DiT step (video + audio)", jax.jit(runner.apply), (runner.params, inp),
                                weights=runner.params, note=f"batch {nb} x ({s:,} video + {la} audio) tokens"))
        units.append(self.plan_vae_unit(request, b, grid))  # the same VAE decode program as LTX-Video
        acfg = self.audio_vae_config()
        avae = nn.Split(*nn.abstract_state(lambda: laudio._build_vae(acfg, encoder=False)), acfg)
        vcfg = self.preset.vocoder if self.preset else laudio.vocoder_config(self._config("vocoder"))
        voc = nn.Split(*nn.abstract_state(lambda: laudio._build_vocoder(vcfg)), vcfg)
        z = vplan.abstract((b, la, acfg.latent_mel_bins, acfg.latent_channels), np.float32)
        mel = jax.eval_shape(lambda st, x: nnx.merge(avae.graphdef, st).decode(x), avae.state, z)  # [B, T, M, C]
        units += [vplan.split_unit("decode", "audio VAE decode", avae, z, method="decode", note=f"{b} x {la} latent frames"),
                  vplan.split_unit("decode", "vocoder", voc, vplan.abstract((b, mel.shape[1], mel.shape[2] * mel.shape[3]),
                                                                           np.float32), note=f"{b} x {mel.shape[1]} mel frames")]
        return units

    def fingerprint(self, component: str) -> str:
        files = {"text": ["text_encoder", "tokenizer", "connectors"], "dit": ["transformer", "scheduler"],
                 "vae": ["vae", "diffusion_decoder"], "image": ["vae"], "audio": ["audio_vae", "vocoder"]}[component]
        return self._fp(component, files)

    # ------------------------------------------------------------------ encode
    def encode_prompts(self, prompts, tok=None, enc=None, conn=None):
        """Gemma 3's hidden states of every layer (left-padded prompts) through the connectors:
        (video embeddings [B, T, Dv], audio embeddings [B, T, Da], mask [B, T]), float32."""
        tok = tok or self.load_tokenizer()
        enc = enc or self.load_text_encoder()
        conn = conn or self.load_connectors()
        ids, mask = self.tokenize(tok, prompts)
        hs = enc.hidden_states(jnp.asarray(ids), jnp.asarray(mask))  # [L+1, B, T, D]
        hs = jnp.transpose(hs, (1, 2, 3, 0))  # [B, T, D, L+1] as torch.stack(..., dim=-1)
        v, a, m = conn(hs, jnp.asarray(mask), padding_side="left")
        return np.asarray(v, np.float32), np.asarray(a, np.float32), np.asarray(m, np.float32)

    def encode_image(self, image, height: int, width: int, crf: int = 33, vae=None) -> np.ndarray:
        """The first frame's normalised latent [1, C, 1, h, w]: re-compressed at ``crf``, bilinear
        resize, the posterior mean ("argmax"), normalised with scaling factor 1."""
        from vidax.text.clip import to_rgb_uint8

        state, cfg, stats = vae or self.load_vae(encoder=True)
        img = apply_crf(to_rgb_uint8(image), crf)
        px = resize_image(img, height, width, resample="bilinear")[None, :, None]
        z = np.asarray(lvae.encode(state, cfg, px))
        return lvae.normalize(stats, cfg, z, scaling_factor=1.0)

    def encode(self, request, image=None) -> dict:
        tok, enc, conn = self.load_tokenizer(), self.load_text_encoder(), self.load_connectors()
        v, a, m = self.encode_prompts(request.prompts, tok, enc, conn)
        neg = request.negative_prompt if request.negative_prompt is not None else ""
        nv, na, nm = self.encode_prompts([neg] * len(request.prompts), tok, enc, conn)
        del enc
        dt = np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)
        at = dict(model=request.model, computed_in="float32", stored_as=str(dt), role="connector output")
        out = {"video_embeds": Named(v.astype(dt), EMB, at), "audio_embeds": Named(a.astype(dt), EMB, at),
               "prompt_mask": Named(m, ("batch", "token")),
               "negative_video_embeds": Named(nv.astype(dt), EMB, at),
               "negative_audio_embeds": Named(na.astype(dt), EMB, at), "negative_mask": Named(nm, ("batch", "token"))}
        if image is not None:
            lat = self.encode_image(image, request.height, request.width, int(request.options.get("image_crf") or 0))
            out["image_latents"] = Named(lat.astype(np.float32), LATENT, {"role": "first frame, normalised"})
        return out

    # ------------------------------------------------------------------ sample
    def latent_grid(self, height, width, num_frames):
        v = self.vae_config()
        return (num_frames - 1) // v.temporal_ratio + 1, height // v.spatial_ratio, width // v.spatial_ratio

    def audio_frames(self, num_frames: int, fps: float) -> int:
        """Audio latent frames for the video's duration (``round(seconds * rate / hop / 4)``)."""
        a = self.audio_vae_config()
        per_second = a.sample_rate / a.mel_hop_length / float(laudio.LATENT_DOWNSAMPLE)
        return round(num_frames / fps * per_second)

    def sample_latents(self, cond: dict, uncond: dict | None, *, seed=0, height=512, width=768, num_frames=121, steps=30,
                       guidance=3.0, fps=24.0, options: dict | None = None, image_latents=None, latents=None,
                       audio_latents=None, start=0, on_step=None, dit=None):
        """(video latents [B, C, F, H, W] normalised, packed audio latents [B, La, Ca] normalised).
        ``cond`` / ``uncond``: ``{"v", "a", "mask"}``; ``options``: the guidance options (defaults
        as ``LTX2Pipeline``); ``latents`` / ``audio_latents``: to resume at ``start``."""
        o = {**{x.name: x.default for x in self.OPTIONS}, **(options or {})}
        params, cfg = dit or self.load_dit()
        grid = self.latent_grid(height, width, num_frames)
        b = cond["v"].shape[0]
        p, pt = cfg.patch_size, cfg.patch_size_t
        tgrid = (grid[0] // pt, grid[1] // p, grid[2] // p)
        seq = tgrid[0] * tgrid[1] * tgrid[2]
        la = self.audio_frames(num_frames, fps)
        sched = make_scheduler(self.scheduler_config(), steps, seq, defaults=(1024, 4096, 0.95, 2.05))
        keep = None if image_latents is None else first_frame_mask(grid)
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = jax.random.normal(key_for(seed, NOISE_LATENTS), (b, *grid, cfg.in_channels), jnp.float32)
            a = jax.random.normal(key_for(seed, NOISE_AUDIO), (b, la, cfg.audio_in_channels), jnp.float32)
            if image_latents is not None:
                init = jnp.asarray(np.asarray(image_latents, np.float32).transpose(0, 2, 3, 4, 1))
                x = init * keep + x * (1.0 - keep)
        else:
            x, a = jnp.asarray(latents, jnp.float32), jnp.asarray(audio_latents, jnp.float32)
        if self.step_cache is not None:  # one state for the step's batch of passes (as LTX-Video's cond_uncond)
            self.step_cache.begin(1, 1, start)
            params.use_cache(self.step_cache)
        model, prm, jit_model, put, stg_blocks = self.av_model(params, cfg, grid, la, fps, keep, o)
        x, a = put(x), put(a)
        f = lambda d: {k: put(jnp.asarray(v, jnp.float32)) for k, v in d.items()}  # noqa: E731
        x, a = sample_av(model, sched, x, a, f(cond), None if uncond is None else f(uncond), guidance=guidance,
                         audio_guidance=float(o["audio_guidance"]), stg=float(o["stg_scale"]),
                         audio_stg=float(o["audio_stg_scale"]), modality=float(o["modality_scale"]),
                         audio_modality=float(o["audio_modality_scale"]), rescale_v=float(o["guidance_rescale"]),
                         rescale_a=float(o["audio_guidance_rescale"]), perturbed_attn=cfg.perturbed_attn and bool(stg_blocks),
                         keep_first=keep, start=start, on_step=on_step, params=prm, jit_model=jit_model,
                         context=self.av_context(params, cfg), one_group=self.step_cache is not None)
        return np.asarray(x).transpose(0, 4, 1, 2, 3), np.asarray(a)

    def av_model(self, params, cfg, grid, la: int, fps: float, keep, options: dict):
        """The audio+video DiT as :func:`sample_av` calls it: ``(model(prm, x, a, t, ctx, actx, mask,
        perturb, xmod) -> (video v, audio v)``, ``prm``, ``jit_model``, ``put``, the STG blocks)``
        for video latents of ``grid``, ``la`` audio latent frames and the known-frame mask ``keep``
        (image-to-video: those tokens at timestep 0)."""
        p, pt = cfg.patch_size, cfg.patch_size_t
        tgrid = (grid[0] // pt, grid[1] // p, grid[2] // p)
        vc = ldit2.video_coords(*tgrid, cfg, fps)
        ac = ldit2.audio_coords(la, cfg)
        ropes = {k: jnp.asarray(v) for k, v in ldit2.rope_tables(cfg, vc, ac).items()}
        stg_blocks = tuple(int(s) for s in str(options.get("stg_blocks") or "").split(",") if s.strip() != ""
                           and int(s) < cfg.num_layers)
        uct = bool(options.get("use_cross_timestep"))
        ktok = None if keep is None else keep[0, ::pt, ::p, ::p, 0].reshape(1, -1)
        from vidax.core.runner import DiTRunner

        runner = params if isinstance(params, DiTRunner) else None
        dt = ldit2.state_dtype(params) if runner is None else jnp.dtype(self.dtype)

        def model(prm, xx, aa, t, ctx, actx, mask, perturb, xmod):
            # a traced step gets (weights, RoPE tables): the tables are arguments, never constants
            prm, rp = prm if prm is not None else (None, ropes)
            n = xx.shape[0]
            tb = jnp.full((n,), t, jnp.float32)
            vt = tb if ktok is None else tb[:, None] * (1.0 - ktok)
            kv = ctx if isinstance(ctx, dict) else None  # the text keys / values computed once (av_context)
            inp = ldit2.model_inputs(
                cfg, pack(xx, p, pt).astype(dt), aa.astype(dt), None if kv is not None else ctx.astype(dt),
                None if kv is not None else actx.astype(dt), vt, rp, ta=tb,
                sigma=tb, mask=mask, amask=mask, use_cross_timestep=uct, perturb=perturb, stg_blocks=stg_blocks,
                isolate=1.0 - xmod)
            out = (ldit2.forward(prm, cfg, inp, context=kv) if runner is None else
                   (runner.apply(prm, inp, context=kv) if prm is not None else runner(inp, context=kv)))
            return unpack(out["y"], tgrid, p, pt), out["ya"]

        jit_model = runner is None or (runner.offload is None and runner.cache is None)
        put = replicated(runner)
        prm = ((params if runner is None else runner.params), jax.tree.map(put, ropes)) if jit_model else None
        return model, prm, jit_model, put, stg_blocks

    def av_context(self, params, cfg):
        """``context(prm, ctx, actx) -> keys / values`` of both streams' text for :func:`sample_av`
        (once per sample stage), or None: ``vidax.core.runner.TEXT_KV_ONCE`` off, or a prompt
        modulation that follows sigma (the keys / values then change every step)."""
        from vidax.core import runner as vrunner

        if isinstance(params, vrunner.DiTRunner):
            if not params.context_inputs:
                return None
            return lambda prm, ctx, actx: params.context({"ctx": ctx, "actx": actx})
        if not vrunner.context_names(ldit2.abstract_model(cfg, ldit2.state_dtype(params).name)):
            return None
        program = _context_program(cfg)
        return lambda prm, ctx, actx: program(params, ctx, actx)

    def sample(self, conditioning, request, *, resume=None, on_step=None) -> dict:
        o = request.options
        use_cfg = request.guidance > 1.0 or float(o.get("audio_guidance") or 0.0) > 1.0
        c = conditioning
        cond = {"v": c["video_embeds"], "a": c["audio_embeds"], "mask": c["prompt_mask"]}
        unc = ({"v": c["negative_video_embeds"], "a": c["negative_audio_embeds"], "mask": c["negative_mask"]}
               if use_cfg else None)
        start, latents, alat = 0, None, None
        if resume is not None:
            start = int(resume["step"])
            latents = np.asarray(resume["arrays"]["latents"], np.float32).transpose(0, 2, 3, 4, 1)
            alat = np.asarray(resume["arrays"]["audio_latents"], np.float32)

        def cb(info, x, a):
            on_step(info, lambda: {"latents": np.asarray(x).transpose(0, 4, 1, 2, 3), "audio_latents": np.asarray(a)})

        v, a = self.sample_latents(cond, unc, seed=request.seed, height=request.height, width=request.width,
                                   num_frames=request.num_frames, steps=request.steps, guidance=request.guidance,
                                   fps=request.fps, options=dict(o), image_latents=c.get("image_latents"),
                                   latents=latents, audio_latents=alat, start=start,
                                   on_step=None if on_step is None else cb)
        return {"latents": Named(v, LATENT, {"model": request.model, "normalised": True}),
                "audio_latents": Named(a, ("batch", "time", "channel"),
                                       {"model": request.model, "normalised": True, "layout": "packed [B, L, C*mel]"})}

    # ------------------------------------------------------------------ decode
    def decode_plan(self, request) -> list[DecodeSpan]:
        f, h, w = self.latent_grid(request.height, request.width, request.num_frames)
        if request.options.get("vae_decoder") == "diffusion":
            plan = [DecodeSpan("decode/0", "video", (0, f))]
        else:
            plan = self.video_plan(request, f, h, w, self.vae_config())
        if request.options.get("audio", True):
            plan.append(DecodeSpan("decode/audio", "audio", inputs=("audio_latents",)))
        return plan

    def decode_latents(self, latents, request, vae=None, tile=None):
        """Normalised video latents -> raw pixels [B, 3, F, H, W]: (timestep-conditioned decoders)
        decode noise mixed in first, then denormalised, as ``LTX2Pipeline``."""
        state, cfg, stats = vae or self.load_vae()
        z = np.asarray(latents, np.float32)
        temb = None
        if cfg.timestep_conditioning:
            o = request.options
            t = float(o.get("decode_timestep") or 0.0)
            s = o.get("decode_noise_scale")
            s = t if s is None else float(s)
            noise = np.asarray(jax.random.normal(key_for(request.seed, NOISE_DECODE), z.shape, jnp.float32))
            z = (1 - np.float32(s)) * z + np.float32(s) * noise
            temb = np.full((z.shape[0],), t, np.float32)
        z = lvae.denormalize(stats, cfg, z)
        if tile is not None:
            y0, y1, x0, x1 = tile
            z = z[..., y0:y1, x0:x1]
        key = key_for(request.seed, NOISE_VAE, 0 if tile is None else tile[0] * 100003 + tile[2]) \
            if any(cfg.decoder_inject_noise) else None
        return np.asarray(lvae.decode(state, cfg, z, temb, key))

    def decode_diffusion(self, latents, request, dd=None):
        """LTX-2.5's diffusion decoder: denormalised latents -> pixels, its pixel noise drawn from the
        run's seed."""
        from vidax.models.ltx import diffusion_decoder as ldd

        split, cfg, stats = dd or self.load_diffusion_decoder()
        if self.mesh is not None:  # tensor parallelism bounds this decoder's memory (heads, SwiGLU width)
            split = ldd.shard(split, self.mesh)
        z = lvae.denormalize(stats, replace(self.vae_config(), scaling_factor=cfg.scaling_factor), latents)
        steps = request.options.get("decoder_steps")
        return ldd.decode(split, cfg, z, key_for(request.seed, NOISE_DECODE, 1), steps)

    def decode_audio(self, audio_latents, audio=None):
        """Packed normalised audio latents [B, La, C*M] -> waveform [B, 2, samples] (float32)."""
        vae, stats, voc = audio or self.load_audio()
        cfg = vae.cfg
        a = np.asarray(audio_latents, np.float32) * stats["latents_std"] + stats["latents_mean"]
        b, la, _ = a.shape
        z = a.reshape(b, la, cfg.latent_channels, cfg.latent_mel_bins).transpose(0, 2, 1, 3)
        mel = laudio.decode_mel(vae, z)
        return laudio.vocode(voc, mel)

    def decode(self, latents, span, carry, request):
        if span.kind == "audio":
            w = self.decode_audio(latents["audio_latents"])
            return {"waveform": Named(w.astype(np.float32), ("batch", "channel", "sample"),
                                      {"sample_rate": int(self.audio_sample_rate())})}, None
        lat = latents["latents"]
        if request.options.get("vae_decoder") == "diffusion":
            px = self.decode_diffusion(lat, request)
            return {"frames": Named(to_uint8(to_unit_range(px)), ("batch", "frame", "height", "width", "rgb"),
                                    {"decoder": "diffusion"})}, None
        px = self.decode_latents(lat, request, tile=span.tile)
        frames, carry = self.finish_tile(px, span, carry, request, lat.shape[-2], lat.shape[-1], self.vae_config())
        return {"frames": Named(frames, ("batch", "frame", "height", "width", "rgb"),
                                {"tile": list(span.tile) if span.tile else None, "units": "uint8 RGB"})}, carry


    # ------------------------------------------------------------------ probe hooks (``vidax probe``)
    # The probe is about the video stream. The audio stream gets, at the same timestep, what
    # sampling would hold at that sigma for the normalised mean audio latent (zero): ``sigma *
    # noise`` from the run's audio noise stream; only the video estimate is returned.
    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The video clean estimate ``x - sigma * v`` per row: the conditional pass of sampling (video
        and audio connector embeddings of the first prompt, no CFG / STG / modality isolation) at
        timestep ``sigma * 1000`` for both streams, the audio stream at ``sigma * noise`` (see above)
        over the clip's duration at the request's fps. Image-to-video: the first latent frame is the
        image's, at per-token timestep 0, and stays the image's in the estimate."""
        r = default_request(self, request)
        params, cfg = self.load_dit()
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        grid = x.shape[1:4]
        fps = r.fps or 24.0
        la = self.audio_frames((grid[0] - 1) * self.vae_config().temporal_ratio + 1, fps)
        img = conditioning.get("image_latents")
        keep = None if img is None else first_frame_mask(grid)
        model, prm, jit_model, put, _ = self.av_model(params, cfg, grid, la, fps, keep, r.options)
        call = jax.jit(model) if jit_model else model
        c = {k: put(jnp.asarray(np.asarray(conditioning[n], np.float32)[:1]))
             for k, n in (("v", "video_embeds"), ("a", "audio_embeds"), ("mask", "prompt_mask"))}
        noise_a = jax.random.normal(key_for(r.seed, NOISE_AUDIO), (1, la, cfg.audio_in_channels), jnp.float32)
        one = put(jnp.ones((1,), jnp.float32))
        out = []
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            xi = with_image(jnp.asarray(x[i:i + 1]), img, keep)
            v, _ = call(prm, put(xi), put(s * noise_a), jnp.float32(s * 1000.0), c["v"], c["a"], c["mask"], one, one)
            out.append(np.asarray(with_image(xi - s * jnp.asarray(v, jnp.float32), img, keep)))
        del params, prm
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)


class LTX2I2V(LTX2):
    """LTX-2.x image-to-video (``LTX2ImageToVideoPipeline`` on the same checkpoint)."""

    def __init__(self, source="tiny", **kw):
        kw.setdefault("image_to_video", True)
        super().__init__(source, **kw)


@functools.lru_cache(maxsize=8)
def _context_program(cfg):
    """The jitted one-device program of both streams' text keys / values, per config."""
    return jax.jit(lambda state, ctx, actx: ldit2.context(state, cfg, ctx, actx))
