"""The LTX-Video 0.9.x pipelines on the vidax protocol: text- and image-to-video, T5-XXL with its mask
(sources, phases and tiled decode: :mod:`vidax.models.ltx.common`)."""
from __future__ import annotations

import functools

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from vidax.models.ltx import dit as ldit
from vidax.models.ltx import vae as lvae
from vidax.models.ltx.common import (EMB, LATENT, NOISE_DECODE, NOISE_IMAGE, NOISE_LATENTS, NOISE_VAE, ProbeVAE, Source,
                                     Tiles, check_prompt_lengths, first_frame_mask, key_for, make_scheduler, pack,
                                     preset_stats, replicated, resize_image, unpack, with_image)
from vidax.models.ltx.sampling import sample_video
from vidax.pipeline import DecodeSpan, Geometry, Named, Option, OptionError, Pipeline
from vidax.text import t5 as t5mod
from vidax.text.tokenizer import ByteTokenizer, load_tokenizer
from vidax.weights.keymap import lazy_params


# ----------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class LTXPreset:
    """A complete, seeded random-weight LTX-Video-shaped model (0.9.1-like: timestep-conditioned
    decoder that injects noise) that runs on a CPU in seconds."""

    text: t5mod.T5Config = field(default_factory=lambda: t5mod.T5Config(
        vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu"))
    dit: ldit.LTXDiTConfig = field(default_factory=lambda: ldit.LTXDiTConfig(
        in_channels=8, out_channels=8, num_heads=2, head_dim=12, cross_attention_dim=24, num_layers=2,
        caption_channels=32))
    vae: lvae.LTXVAEConfig = field(default_factory=lambda: lvae.LTXVAEConfig(
        latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(True, True, True, False),
        upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True))
    max_text_len: int = 128
    seed: int = 0


PRESETS = {"tiny": LTXPreset()}


# ----------------------------------------------------------------------------------- LTX-Video 0.9
class LTXVideo(ProbeVAE, Source, Tiles, Pipeline):
    """LTX-Video 0.9.x text-to-video (``LTXPipeline``); with ``image_to_video=True`` (or an
    ``LTXImageToVideoPipeline`` folder) image-to-video: the first latent frame is the image's VAE
    latent, kept through sampling with per-token timestep 0."""

    FAMILY = "ltx"
    STEP_CACHE = True
    OPTIONS = (
        Option("guidance_rescale", float, 0.0, "rescale the guided velocity toward the conditional one's std",
               minimum=0.0, maximum=1.0),
        Option("decode_timestep", float, 0.0, "timestep-conditioned VAE decoders: the decode timestep",
               minimum=0.0, maximum=1.0, stages=("decode:video",)),
        Option("decode_noise_scale", float, None, "noise mixed into the latents before a timestep-conditioned "
               "decode (default: decode_timestep)", minimum=0.0, maximum=1.0, stages=("decode:video",)),
        Option("vae_tiling", bool, False, "decode in spatial tiles, one persisted stage each (the reference's "
               "enable_tiling: 512 px tiles, 448 px stride)", stages=("decode",)),
    )
    COMPONENTS = {"encode": ("text",), "image": ("vae",), "sample": ("dit",), "decode": ("vae",)}
    CODE_DEPS = ("vidax.text",)
    MAX_TEXT = 128

    def __init__(self, source="tiny", *, dtype=np.float32, mesh=None, parallelism=None, offload_chunk_size=None,
                 prefetch: bool = True, image_to_video: bool | None = None):
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism, self.offload_chunk_size, self.prefetch = mesh, parallelism, offload_chunk_size, prefetch
        self._init_source(source, PRESETS)
        cls = self.index.get("_class_name", "LTXPipeline")
        self.image_to_video = cls == "LTXImageToVideoPipeline" if image_to_video is None else bool(image_to_video)

    # ------------------------------------------------------------------ configs
    def dit_config(self) -> ldit.LTXDiTConfig:
        return self.preset.dit if self.preset else ldit.LTXDiTConfig.from_diffusers(self._config("transformer"))

    def vae_config(self) -> lvae.LTXVAEConfig:
        return self.preset.vae if self.preset else lvae.LTXVAEConfig.from_diffusers(self._config("vae"))

    def geometry(self) -> Geometry:
        d, v = self.dit_config(), self.vae_config()
        return Geometry(spatial=v.spatial_ratio, temporal=v.temporal_ratio, latent_channels=d.out_channels,
                        patch=(d.patch_size_t, d.patch_size, d.patch_size), num_heads=d.num_heads)

    def weight_loaders(self, request) -> list:
        enc = getattr(request, "image", None) is not None or self.image_to_video
        return [("text encoder", self.load_text_encoder),
                ("DiT", lambda: ldit.load_dit(self.folder / "transformer", self.dit_config(), dtype=self.dtype)),
                ("VAE", lambda: self.load_vae(encoder=enc))]

    def check(self, request) -> None:
        if self.preset is None and self._folder is None:
            return
        if self.folder is not None:
            need = ["text_encoder", "tokenizer", "transformer", "vae", "scheduler"]
            missing = [n for n in need if not (self.folder / n).is_dir()]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {', '.join(missing)}/ (diffusers layout)")
        check_prompt_lengths(self.load_tokenizer(), request, self.MAX_TEXT)

    def stage_params(self, kind, request, span=None):
        p = super().stage_params(kind, request, span)
        if kind == "sample":
            p["fps"] = request.fps  # the rotary grid's time axis is in seconds (frame_rate)
        return p

    # ------------------------------------------------------------------ components
    def load_tokenizer(self):
        return ByteTokenizer() if self.preset else load_tokenizer(self.folder / "tokenizer")

    def load_text_encoder(self):
        if self.preset:
            from vidax.models.ltx.layers import seeded_split

            g, st = seeded_split(t5mod._build(self.preset.text, 0, np.float32), self.preset.seed + 1)
            return t5mod.T5Encoder(g, jax.device_put(st), self.preset.text)
        return t5mod.load_t5(self.folder / "text_encoder", dtype=np.float32, mesh=self.text_mesh())  # tp over the slice

    def lora_targets(self) -> dict:
        from vidax.models.ltx import lora as llora

        return self.transformer_lora_targets(llora.aliases(self.dit_config()), "this LTX-Video DiT (transformer)")

    def load_dit(self):
        """(state on device, cfg), or (a :class:`DiTRunner`, cfg) on a mesh / with offloading."""
        cfg = self.dit_config()
        if self.preset:
            state = ldit.init_state(cfg, seed=self.preset.seed + 2, dtype=self.dtype)
        else:
            with self.lora_merging("dit"), lazy_params(self.mesh is not None and self.offload_chunk_size is None):
                state, cfg = ldit.load_dit(self.folder / "transformer", cfg, dtype=self.dtype)
        if self.mesh is None and self.offload_chunk_size is None and self.step_cache is None:
            return jax.device_put(state), cfg
        return ldit.runner(state, cfg, self.mesh, self.parallelism, offload_chunk_size=self.offload_chunk_size,
                           prefetch=self.prefetch), cfg

    def load_vae(self, encoder: bool = False):
        cfg = self.vae_config()
        if self.preset:
            return jax.device_put(lvae.init_state(cfg, seed=self.preset.seed + 3)), cfg, preset_stats(cfg, self.preset.seed + 3)
        state, cfg, stats = lvae.load_vae(self.folder / "vae", cfg, encoder=encoder)
        return jax.device_put(state), cfg, stats

    def text_config(self) -> t5mod.T5Config:
        """T5-XXL's config without its weights."""
        return self.preset.text if self.preset else t5mod.T5Config.from_hf(self._config("text_encoder"))

    def plan_units(self, request) -> list:
        """T5 over the prompts with their mask (float32); one DiT call on the guidance batch (per-token
        timesteps for image-to-video) on this pipeline's mesh; the VAE decode one decode stage runs
        (the whole clip, or the first spatial tile with ``vae_tiling``)."""
        from vidax.core import plan as vplan

        b, n = len(request.prompts), self.MAX_TEXT
        tp = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoder splits it
        units = [t5mod.plan_unit(self.text_config(), b, n, tp=tp)]
        cfg = self.dit_config()
        runner = ldit.runner(ldit.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if request.guidance != 1.0 else b
        grid = self.latent_grid(request.height, request.width, request.num_frames)
        s = (grid[0] // cfg.patch_size_t) * (grid[1] // cfg.patch_size) * (grid[2] // cfg.patch_size)
        cos, sin = self.rope(cfg, grid, float(request.fps or 25))
        c = cfg.in_channels * cfg.patch_size_t * cfg.patch_size ** 2
        args = (vplan.abstract((nb, s, c), self.dtype), vplan.abstract((nb, s) if self.image_to_video else (nb,), np.float32),
                vplan.abstract((nb, n, cfg.caption_channels), self.dtype), vplan.abstract((nb, n), np.float32),
                vplan.like(cos), vplan.like(sin))
        inp = jax.eval_shape(lambda *a: ldit.model_inputs(cfg, *a), *args)
        units.append(vplan.Unit("sample", "DiT step", jax.jit(runner.apply), (runner.params, inp), weights=runner.params,
                                note=f"batch {nb} x {s:,} tokens"))
        units.append(self.plan_vae_unit(request, b, grid))
        return units

    def fingerprint(self, component: str) -> str:
        files = {"text": ["text_encoder", "tokenizer"], "dit": ["transformer"], "vae": ["vae"],
                 "image": ["vae"]}[component]
        if component == "dit":
            files = files + ["scheduler"]
        return self._fp(component, files)

    # ------------------------------------------------------------------ phases
    def encode_prompts(self, prompts, tok=None, enc=None):
        """(embeddings [B, 128, D] float32, mask [B, 128]) as ``_get_t5_prompt_embeds``."""
        tok = tok or self.load_tokenizer()
        enc = enc or self.load_text_encoder()
        ids, mask = tok([p.strip() for p in prompts], self.MAX_TEXT)
        h = np.asarray(enc(jnp.asarray(ids), jnp.asarray(mask)), np.float32)
        return h, np.asarray(mask, np.float32)

    def encode_image(self, image, height: int, width: int, seed: int, vae=None) -> np.ndarray:
        """The first frame's normalised latent [1, C, 1, h, w]: a posterior sample (the reference
        samples with the run's generator), normalised with scaling factor 1 as ``prepare_latents``."""
        state, cfg, stats = vae or self.load_vae(encoder=True)
        px = resize_image(image, height, width)[None, :, None]
        z = np.asarray(lvae.encode_sample(state, cfg, px, key_for(seed, NOISE_IMAGE)))
        return lvae.normalize(stats, cfg, z, scaling_factor=1.0)

    def encode(self, request, image=None) -> dict:
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond, cmask = self.encode_prompts(request.prompts, tok, enc)
        neg = request.negative_prompt if request.negative_prompt is not None else ""
        unc, umask = self.encode_prompts([neg] * len(request.prompts), tok, enc)
        del enc
        dt = np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)
        attrs = dict(model=request.model, computed_in="float32", stored_as=str(dt))
        out = {"prompt_embeds": Named(cond.astype(dt), EMB, attrs), "prompt_mask": Named(cmask, ("batch", "token")),
               "negative_embeds": Named(unc.astype(dt), EMB, attrs), "negative_mask": Named(umask, ("batch", "token"))}
        if image is not None:
            lat = self.encode_image(image, request.height, request.width, request.seed)
            out["image_latents"] = Named(lat.astype(np.float32), LATENT, {"role": "first frame, normalised"})
        return out

    def latent_grid(self, height, width, num_frames):
        v = self.vae_config()
        return (num_frames - 1) // v.temporal_ratio + 1, height // v.spatial_ratio, width // v.spatial_ratio

    def rope(self, cfg, grid, fps: float):
        v = self.vae_config()
        f, h, w = grid
        ris = (v.temporal_ratio / fps, v.spatial_ratio, v.spatial_ratio)
        g = ldit.video_coords(f // cfg.patch_size_t, h // cfg.patch_size, w // cfg.patch_size, ris, cfg)
        return ldit.rope_tables(g, cfg)

    def sample_latents(self, cond, cmask, uncond=None, umask=None, *, seed=0, height=512, width=704, num_frames=161,
                       steps=50, guidance=3.0, fps=25.0, guidance_rescale=0.0, image_latents=None, latents=None,
                       start=0, on_step=None, dit=None):
        """Final latents [B, C, F, H, W] (normalised). ``latents``: channels-last to resume from at
        step ``start`` (the state after step ``start - 1``)."""
        d = dit or self.load_dit()
        params, cfg = d
        grid = self.latent_grid(height, width, num_frames)
        b = cond.shape[0]
        seq = (grid[0] // cfg.patch_size_t) * (grid[1] // cfg.patch_size) * (grid[2] // cfg.patch_size)
        sched = make_scheduler(self.scheduler_config(), steps, seq)
        keep = None if image_latents is None else first_frame_mask(grid)
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = jax.random.normal(key_for(seed, NOISE_LATENTS), (b, *grid, cfg.in_channels), jnp.float32)
            if image_latents is not None:
                init = jnp.asarray(np.asarray(image_latents, np.float32).transpose(0, 2, 3, 4, 1))  # [1, 1, h, w, C]
                x = init * keep + x * (1.0 - keep)
        else:
            x = jnp.asarray(latents, jnp.float32)
        if self.step_cache is not None:  # one state for the [cond; uncond] batch (diffusers' "cond_uncond")
            self.step_cache.begin(1, 1, start)
            params.use_cache(self.step_cache)
        model, prm, jit_model, put = self.video_model(params, cfg, grid, fps)
        x = put(x)
        c = {"ctx": put(jnp.asarray(cond, jnp.float32)), "mask": put(jnp.asarray(cmask, jnp.float32))}
        u = None if uncond is None else {"ctx": put(jnp.asarray(uncond, jnp.float32)),
                                         "mask": put(jnp.asarray(umask, jnp.float32))}
        x, _ = sample_video(model, sched, x, c, u, guidance=guidance, guidance_rescale=guidance_rescale, keep_first=keep,
                            start=start, on_step=on_step, params=prm, jit_model=jit_model,
                            context=self.video_context(params, cfg))
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    def video_model(self, params, cfg, grid, fps: float):
        """The DiT as the sampling loop calls it: ``(model(prm, x, t, ctx, mask) -> v`` on channels-last
        latents of ``grid`` with timesteps [B] or per-token [B, S], ``prm`` (its first argument),
        ``jit_model`` (False for an offloading runner, called from Python), ``put`` (places loop
        arrays as the runner's programs expect))."""
        cos, sin = self.rope(cfg, grid, fps)
        cos, sin = jnp.asarray(cos), jnp.asarray(sin)
        p, pt = cfg.patch_size, cfg.patch_size_t
        from vidax.core.runner import DiTRunner

        runner = params if isinstance(params, DiTRunner) else None
        dt = ldit.state_dtype(params) if runner is None else jnp.dtype(self.dtype)

        def model(prm, xx, tt, ctx, mask):
            # a traced step gets (weights, RoPE tables) as its argument: the tables are never
            # compiled-in constants; a streaming runner (called from Python) gets None. ``ctx``: the
            # text, or its keys / values computed once (a dict, :meth:`video_context`)
            w, (c, s) = prm if prm is not None else (None, (cos, sin))
            kv = ctx if isinstance(ctx, dict) else None
            inp = ldit.model_inputs(cfg, pack(xx, p, pt).astype(dt), tt, None if kv is not None else ctx.astype(dt),
                                    mask, c, s)
            out = ldit.forward(w, cfg, inp, context=kv) if runner is None else (
                runner.apply(w, inp, context=kv) if w is not None else runner(inp, context=kv))
            return unpack(out["y"], (grid[0] // pt, grid[1] // p, grid[2] // p), p, pt)

        jit_model = runner is None or (runner.offload is None and runner.cache is None)
        put = replicated(runner)
        prm = ((params if runner is None else runner.params), (put(cos), put(sin))) if jit_model else None
        return model, prm, jit_model, put

    def video_context(self, params, cfg):
        """``context(prm, ctx) -> keys / values`` of the text for :func:`sample_video` (computed once
        per sample stage), or None (``vidax.core.runner.TEXT_KV_ONCE`` off: per step)."""
        from vidax.core import runner as vrunner

        if not vrunner.context_names(ldit.LTXTransformer):
            return None
        if isinstance(params, vrunner.DiTRunner):
            return lambda prm, ctx: params.context({"ctx": ctx})
        program = _context_program(cfg)
        return lambda prm, ctx: program(params, ctx)

    def sample(self, conditioning, request, *, resume=None, on_step=None) -> dict:
        o = request.options
        use_cfg = request.guidance > 1.0
        start, latents = 0, None
        if resume is not None:
            start = int(resume["step"])
            latents = np.asarray(resume["arrays"]["latents"], np.float32).transpose(0, 2, 3, 4, 1)

        def cb(info, x, st):
            on_step(info, lambda: {"latents": np.asarray(x).transpose(0, 4, 1, 2, 3)})

        lat = self.sample_latents(
            conditioning["prompt_embeds"], conditioning["prompt_mask"],
            conditioning.get("negative_embeds") if use_cfg else None, conditioning.get("negative_mask") if use_cfg else None,
            seed=request.seed, height=request.height, width=request.width, num_frames=request.num_frames,
            steps=request.steps, guidance=request.guidance, fps=request.fps,
            guidance_rescale=o.get("guidance_rescale") or 0.0, image_latents=conditioning.get("image_latents"),
            latents=latents, start=start, on_step=None if on_step is None else cb)
        return {"latents": Named(lat, LATENT, {"model": request.model, "normalised": True})}

    # ------------------------------------------------------------------ decode
    def decode_plan(self, request) -> list[DecodeSpan]:
        f, h, w = self.latent_grid(request.height, request.width, request.num_frames)
        return self.video_plan(request, f, h, w, self.vae_config())

    def decode_latents(self, latents, request, vae=None, tile=None):
        """Normalised latents [B, C, F, H, W] -> raw pixels [B, 3, F', H', W'] (numpy), as the
        pipeline decodes: denormalise, then (timestep-conditioned decoders) mix in decode noise
        drawn from the run's seed and decode at ``decode_timestep``. ``tile``: a latent box."""
        state, cfg, stats = vae or self.load_vae()
        z = lvae.denormalize(stats, cfg, latents)
        temb = None
        if cfg.timestep_conditioning:
            o = request.options
            t = float(o.get("decode_timestep") or 0.0)
            s = o.get("decode_noise_scale")
            s = t if s is None else float(s)
            noise = np.asarray(jax.random.normal(key_for(request.seed, NOISE_DECODE), z.shape, jnp.float32))
            z = (1 - np.float32(s)) * z + np.float32(s) * noise
            temb = np.full((z.shape[0],), t, np.float32)
        index = 0
        if tile is not None:
            y0, y1, x0, x1 = tile
            z = z[..., y0:y1, x0:x1]
            index = y0 * 100003 + x0
        key = key_for(request.seed, NOISE_VAE, index) if any(cfg.decoder_inject_noise) else None
        return np.asarray(lvae.decode(state, cfg, z, temb, key))

    def decode(self, latents, span, carry, request):
        lat = latents["latents"]
        px = self.decode_latents(lat, request, tile=span.tile)
        frames, carry = self.finish_tile(px, span, carry, request, lat.shape[-2], lat.shape[-1], self.vae_config())
        return {"frames": Named(frames, ("batch", "frame", "height", "width", "rgb"),
                                {"tile": list(span.tile) if span.tile else None, "units": "uint8 RGB"})}, carry

    # ------------------------------------------------------------------ probe hooks (``vidax probe``)
    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The clean estimate ``x - sigma * v`` per row: one DiT call at timestep ``sigma * 1000`` (the
        scheduler's units) with the first prompt's T5 embeddings and mask, the rotary grid at the
        request's fps, no guidance. Image-to-video: the first latent frame is the image's, at
        per-token timestep 0, and stays the image's in the estimate (as sampling keeps it)."""
        params, cfg = self.load_dit()
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        grid = x.shape[1:4]
        model, prm, jit_model, put = self.video_model(params, cfg, grid, getattr(request, "fps", None) or 25.0)
        call = jax.jit(model) if jit_model else model
        ctx = put(jnp.asarray(np.asarray(conditioning["prompt_embeds"], np.float32)[:1]))
        mask = put(jnp.asarray(np.asarray(conditioning["prompt_mask"], np.float32)[:1]))
        img = conditioning.get("image_latents")
        keep = None if img is None else first_frame_mask(grid)
        out = []
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            xi = with_image(jnp.asarray(x[i:i + 1]), img, keep)
            t = jnp.float32(s * 1000.0)
            tt = jnp.full((1,), t, jnp.float32) if keep is None else (t * (1.0 - keep[..., 0])).reshape(1, -1)
            x0 = xi - s * jnp.asarray(call(prm, put(xi), put(tt), ctx, mask), jnp.float32)
            out.append(np.asarray(with_image(x0, img, keep)))
        del params, prm
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    def generate(self, prompt, negative_prompt=None, *, image=None, seed=0, height=512, width=704, num_frames=161,
                 steps=50, guidance=3.0, fps=25.0, **options):
        """Prompt(s) (+ image) -> uint8 frames [B, F, H, W, 3], through the same phases."""
        from types import SimpleNamespace

        opts = {o.name: o.default for o in self.OPTIONS}
        opts.update(options)
        req = SimpleNamespace(model="ltx", prompts=[prompt] if isinstance(prompt, str) else list(prompt),
                              negative_prompt=negative_prompt, seed=seed, height=height, width=width,
                              num_frames=num_frames, steps=steps, guidance=guidance, fps=fps, dtype="float32",
                              options=opts, decode_stages=None)
        cond = {k: v.array for k, v in self.encode(req, image).items()}
        lat = self.sample(cond, req)["latents"].array
        parts, carry = [], None
        for span in self.decode_plan(req):
            out, carry = self.decode({"latents": lat}, span, carry, req)
            parts.append((span, out["frames"].array))
        return self.assemble_video(parts)


class LTXVideoI2V(LTXVideo):
    """LTX-Video 0.9.x image-to-video (``LTXImageToVideoPipeline`` on the same checkpoint)."""

    def __init__(self, source="tiny", **kw):
        kw.setdefault("image_to_video", True)
        super().__init__(source, **kw)


@functools.lru_cache(maxsize=8)
def _context_program(cfg):
    """The jitted one-device program of the text keys / values (once per sample stage), per config."""
    return jax.jit(lambda state, ctx: ldit.context(state, cfg, ctx))
