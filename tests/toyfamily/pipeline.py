"""The toy audio+video family (tests only): deterministic, seeded, tiny."""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.sampling import StepInfo
from vidax.pipeline import DecodeSpan, Geometry, Named, Option, Pipeline, temporal_spans

SAMPLE_RATE = 8000


class ToyAV(Pipeline):
    FAMILY = "toy"
    GUIDANCE = "embedded"
    OUTPUTS = ("video", "audio")
    OPTIONS = (
        Option("audio", bool, True, "generate a sound track", stages=("sample", "decode", "mux")),
        Option("tone", float, 440.0, "base tone of the sound track (Hz)", minimum=20.0, maximum=4000.0,
               stages=("decode:audio",)),
    )

    def __init__(self, source="tiny", dtype="float32", mesh=None, offload_chunk_size=None):
        if source != "tiny":
            raise ValueError(f"toy family: unknown source {source!r}")
        self.mesh, self.offload_chunk_size = mesh, offload_chunk_size

    def geometry(self):
        return Geometry(spatial=16, temporal=8, latent_channels=4, patch=(1, 1, 1), num_heads=2)

    def fingerprint(self, component):
        return f"toy:{component}"

    def encode(self, request, image=None):
        def emb(p):
            h = np.frombuffer(hashlib.sha256(p.encode()).digest(), np.uint8).astype(np.float32)
            return (h[:8] / 128.0 - 1.0)[None]
        e = np.stack([emb(p) for p in request.prompts])  # [B, 1, 8]
        return {"text": Named(e, ("batch", "token", "channel"))}

    def sample(self, conditioning, request, *, resume=None, on_step=None):
        g = self.geometry()
        b = conditioning["text"].shape[0]
        shape = (b, 4, g.latent_frames(request.num_frames), request.height // 16, request.width // 16)
        audio = bool(request.options.get("audio"))
        ashape = (b, 2, 4 * g.latent_frames(request.num_frames))
        key = jax.random.key(request.seed)
        if resume is None:
            start = 0
            x = jax.random.normal(jax.random.fold_in(key, 10_000), shape)
            a = jax.random.normal(jax.random.fold_in(key, 10_001), ashape)
        else:
            start = resume["step"]
            x, a = jnp.asarray(resume["arrays"]["latents"]), jnp.asarray(resume["arrays"]["audio_latents"])
        c = jnp.asarray(conditioning["text"]).mean(axis=(1, 2))
        n = request.steps

        @jax.jit
        def step(x, a, i):
            t = 1.0 - i / n
            target = jnp.tanh(c * request.guidance)[:, None, None, None, None]
            noise = jax.random.normal(jax.random.fold_in(key, i), x.shape)
            x = x + (target - x) / (n - i) + 0.01 * t * noise
            a = a + (jnp.sin(a + c[:, None, None]) - a) / (n - i)
            return x, a

        for i in range(start, n):
            x, a = step(x, a, i)
            x.block_until_ready()
            if on_step is not None:
                on_step(StepInfo(i, n, float(1.0 - i / n), 0.0),
                        lambda x=x, a=a: {"latents": np.asarray(x), "audio_latents": np.asarray(a)})
        out = {"latents": Named(np.asarray(x), ("batch", "channel", "frame", "height", "width"))}
        if audio:
            out["audio_latents"] = Named(np.asarray(a), ("batch", "channel", "time"))
        return out

    def decode_plan(self, request):
        plan = temporal_spans(self.geometry().latent_frames(request.num_frames), request.decode_stages)
        if request.options.get("audio"):
            plan.append(DecodeSpan("decode/audio", "audio", inputs=("audio_latents",)))
        return plan

    def decode(self, latents, span, carry, request):
        if span.kind == "audio":
            a = latents["audio_latents"]  # [B, 2, T]
            seconds = request.num_frames / request.fps
            n = int(round(seconds * SAMPLE_RATE))
            t = np.arange(n) / SAMPLE_RATE
            env = np.interp(np.linspace(0, a.shape[-1] - 1, n), np.arange(a.shape[-1]), np.arange(a.shape[-1]))
            tone = float(request.options.get("tone") or 440.0)
            w = 0.3 * np.sin(2 * np.pi * tone * t)[None, None] * np.cos(a[..., env.astype(int)])
            return {"waveform": Named(w.astype(np.float32), ("batch", "channel", "sample"),
                                      {"sample_rate": SAMPLE_RATE})}, None
        a, b = span.frames
        z = latents["latents"][:, :, a:b]  # [B, 4, f, h, w]
        prev = carry["last"] if carry is not None else np.zeros_like(z[:, :, :1])
        frames = []
        for k in range(z.shape[2]):
            cur = z[:, :, k:k + 1]
            reps = 1 if (a + k) == 0 else 8  # the first latent frame is one video frame, the rest 8
            for r in range(reps):
                w = (r + 1) / reps
                frames.append((1 - w) * prev + w * cur)
            prev = cur
        v = np.concatenate(frames, axis=2)[:, :3]  # [B, 3, F, h, w]
        v = v.repeat(16, axis=3).repeat(16, axis=4)
        px = np.clip((np.tanh(v) + 1) * 127.5, 0, 255).round().astype(np.uint8).transpose(0, 2, 3, 4, 1)
        return {"frames": Named(px, ("batch", "frame", "height", "width", "rgb"))}, {"last": prev}

    # probe hooks (``vidax probe``): the toy "VAE" is the decode above (8x temporal, 16x spatial);
    # its encoder pools 16x16 cells of every 8th frame and inverts the tanh
    def vae_encode(self, video):
        v = np.asarray(video, np.float32)[:, :, ::8]  # [B, 3, f, H, W], the frames the decoder lands on
        b, c, f, h, w = v.shape
        pooled = v.reshape(b, c, f, h // 16, 16, w // 16, 16).mean(axis=(4, 6))
        z = np.arctanh(np.clip(pooled, -0.999, 0.999))
        return np.concatenate([z, np.zeros_like(z[:, :1])], axis=1)  # [B, 4, f, h, w]

    def vae_decode(self, latents):
        z = np.asarray(latents, np.float32)
        out, _ = self.decode({"latents": z}, DecodeSpan("decode/0", "video", (0, z.shape[2])), None, None)
        return out["frames"].array.astype(np.float32) / 255.0

    def denoise_once(self, latents, sigmas, conditioning, request=None):
        c = float(np.asarray(conditioning["text"], np.float32)[0].mean())
        s = np.asarray(sigmas, np.float32).reshape(-1, 1, 1, 1, 1)
        return (1.0 - s) * np.asarray(latents, np.float32) + s * np.tanh(c)
