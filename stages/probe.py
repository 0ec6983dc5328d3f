"""``vidax probe``: a low-noise reconstruction probe for any registered model.

A real image (or clip) is encoded with the model's VAE, noised to a range of noise levels, given to
the model for **one** denoising step (its clean estimate, no guidance), and decoded. The PSNR of
that reconstruction against the original, per noise level, separates the usual failure modes:

- a model whose weights, attention and positions are right reconstructs the image almost
  perfectly at low noise (the curve starts near the VAE's own round-trip PSNR) and degrades
  smoothly as the noise grows;
- wrong **noise-level handling** (a timestep in the wrong units, an extra preconditioning
  transform, sigma where t is expected) shows as a curve that *collapses at low noise* -- the
  model "removes" noise that is not there and paints texture or grid-like blobs -- while the same
  weights do fine at some other level;
- wrong weights or architecture show as a low curve everywhere;
- the **conditioning check** runs the same probe with an empty prompt: the prompt's effect on the
  prediction (relative latent change) should be ~0 at low noise and grow with the noise. A
  prompt effect that stays near zero at high noise means the conditioning is not reaching the
  model (or is under-scaled: "plausible but ignores the prompt").

Outputs: a table (stdout), ``probe.json``, ``probe.png`` (PSNR vs sigma + the prompt effect, drawn
with Pillow) and ``probe_frames.png`` (original, noisy input and reconstruction per level).

The probe drives the family through the pipeline protocol's probe hooks
(:meth:`vidax.pipeline.Pipeline.vae_encode`, ``vae_decode``, ``add_noise``, ``denoise_once``) and
``encode``; nothing here names a family.

    vidax probe --model cosmos2.5-2b --checkpoint /models/Cosmos-Predict2.5-2B --image photo.jpg
    from stages.probe import probe; result = probe("wan2.1-t2v-1.3b", image="photo.jpg", out="probe/")
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_SIGMAS = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)
DEFAULT_PROMPT = "a photograph"


@dataclass
class ProbeRow:
    sigma: float
    psnr_noisy: float  # the noised latents, decoded (what the model was given)
    psnr: float  # one-step reconstruction with the prompt
    psnr_no_prompt: float  # the same with an empty prompt
    prompt_effect: float  # rms(x0_prompt - x0_empty) / rms(x0_empty) in latent space


@dataclass
class ProbeResult:
    model: str
    height: int
    width: int
    num_frames: int
    vae_psnr: float  # decode(encode(x)) vs x: the ceiling of any reconstruction
    rows: list[ProbeRow]
    files: dict = field(default_factory=dict)  # png, frames_png, json

    def table(self) -> str:
        head = f"{'sigma':>6} {'noisy':>8} {'1-step':>8} {'no prompt':>10} {'prompt effect':>14}"
        lines = [f"probe {self.model} {self.width}x{self.height}x{self.num_frames}: VAE round trip "
                 f"{self.vae_psnr:.2f} dB", head]
        for r in self.rows:
            lines.append(f"{r.sigma:6.3f} {r.psnr_noisy:8.2f} {r.psnr:8.2f} {r.psnr_no_prompt:10.2f} "
                         f"{100 * r.prompt_effect:13.2f}%")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"model": self.model, "height": self.height, "width": self.width, "num_frames": self.num_frames,
                "vae_psnr": self.vae_psnr, "rows": [dataclasses.asdict(r) for r in self.rows],
                "files": {k: str(v) for k, v in self.files.items()}}


def psnr(a, b) -> float:
    """PSNR in dB of two videos in [0, 1] (over every pixel, frame and channel)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * math.log10(1.0 / mse)


def pattern_image(height: int = 256, width: int = 256) -> np.ndarray:
    """A deterministic photo-like test image (smooth gradients, a disc, stripes and a checker
    corner) used when no image is given. uint8 [H, W, 3]."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    img = np.stack([0.15 + 0.7 * u, 0.2 + 0.6 * v, 0.55 + 0.35 * np.sin(3.0 * u + 2.0 * v)], axis=-1)
    disc = ((u - 0.62) ** 2 + (v - 0.42) ** 2) < 0.05
    img[disc] = [0.92, 0.78, 0.25]
    stripes = (v > 0.72) & (np.sin(40 * u) > 0)
    img[stripes] *= 0.45
    checker = (u < 0.3) & (v < 0.3) & (((x // 8) + (y // 8)) % 2 == 0)
    img[checker] = 0.9
    return np.clip(np.round(img * 255), 0, 255).astype(np.uint8)


def _resize(img: np.ndarray, height: int, width: int) -> np.ndarray:
    import PIL.Image

    im = PIL.Image.fromarray(np.asarray(img, np.uint8)).resize((width, height), PIL.Image.Resampling.LANCZOS)
    return np.asarray(im.convert("RGB"))


def _load_frames(image, video) -> np.ndarray:
    """uint8 [F, H, W, 3] from an image / video (arrays or paths / URLs), or the test pattern."""
    if image is not None and video is not None:
        raise ValueError("give an image or a video, not both")
    if video is not None:
        if isinstance(video, (str, Path)):
            import imageio.v3 as iio

            return np.asarray(iio.imread(Path(video), plugin="FFMPEG"))
        return np.asarray(video, np.uint8)
    if image is None:
        return pattern_image()[None]
    if isinstance(image, (str, Path)):
        from stages.images import load_image

        return load_image(str(image))[None]
    return np.asarray(image, np.uint8)[None]


def probe(model: str | None = None, *, preset: str | None = "tiny", checkpoint: str | None = None, image=None,
          video=None, prompt: str = DEFAULT_PROMPT, sigmas=DEFAULT_SIGMAS, seed: int = 0, height: int | None = None,
          width: int | None = None, num_frames: int | None = None, out: str | Path | None = None,
          dtype: str = "float32", mesh: str | None = None, offload_chunk_size=None, options: dict | None = None,
          log=print) -> ProbeResult:
    """Run the probe; returns a :class:`ProbeResult` (files written under ``out``, default
    ``./vidax-probe/<model>``). ``image`` / ``video``: arrays (uint8 [H, W, 3] / [F, H, W, 3]) or
    paths/URLs; neither: a built-in test pattern. ``num_frames`` (default 1 for an image, the
    longest valid clip for a video) and the size (default: the model's) follow the model's rules."""
    from stages.request import Request, validate
    from stages.run import make_pipeline
    from vidax import registry

    model = model or registry.default_model()
    recipe = registry.get(model)
    frames = _load_frames(image, video)
    sig = np.asarray(sorted(float(s) for s in sigmas), np.float32)
    if not len(sig) or sig.min() <= 0.0 or sig.max() >= 1.0:
        raise ValueError(f"sigmas must be in (0, 1), got {list(sigmas)}")
    geo = recipe.build(None if checkpoint else preset, checkpoint, recipe.image == "required", dtype=dtype).geometry()
    tf = geo.temporal
    if num_frames is None:
        num_frames = 1 if len(frames) == 1 else (len(frames) - 1) // tf * tf + 1
    if num_frames > len(frames):
        frames = np.concatenate([frames, np.repeat(frames[-1:], num_frames - len(frames), axis=0)])
    frames = frames[:num_frames]
    tmp = None
    image_path = None
    if recipe.image == "required":  # an image-conditioned model: the probe image is its condition too
        import PIL.Image

        tmp = tempfile.TemporaryDirectory()
        image_path = str(Path(tmp.name) / "probe.png")
        PIL.Image.fromarray(frames[0]).save(image_path)
    try:
        req = validate(Request(model=model, prompt=prompt, preset=preset, checkpoint=checkpoint, seed=seed,
                               height=height, width=width, num_frames=num_frames, dtype=dtype, mesh=mesh,
                               offload_chunk_size=offload_chunk_size, image=image_path, options=dict(options or {})))
        pipe = make_pipeline(req)
        h, w, f = req.height, req.width, req.num_frames
        log(f"probe {model}: {w}x{h}, {f} frame(s), sigmas {', '.join(f'{s:g}' for s in sig)}")
        orig = np.stack([_resize(fr, h, w) for fr in frames]).astype(np.float32) / 255.0  # [F, H, W, 3]
        px = (orig * 2.0 - 1.0).transpose(3, 0, 1, 2)[None]  # [1, 3, F, H, W]
        cond_image = None
        if image_path is not None:
            from stages.images import load_image

            cond_image = load_image(image_path)
        x0 = np.asarray(pipe.vae_encode(px), np.float32)
        ceiling = psnr(_first(pipe.vae_decode(x0)), orig)
        rng = np.random.default_rng(seed)
        noise = rng.standard_normal(x0.shape).astype(np.float32)
        n = len(sig)
        xs = pipe.add_noise(np.repeat(x0, n, axis=0), np.repeat(noise, n, axis=0), sig)
        with_prompt = {k: v.array for k, v in pipe.encode(req, cond_image).items()}
        empty = dataclasses.replace(req, prompt="", negative_prompt=None)
        no_prompt = {k: v.array for k, v in pipe.encode(empty, cond_image).items()}
        est = np.asarray(pipe.denoise_once(xs, sig, with_prompt, req), np.float32)
        est_u = np.asarray(pipe.denoise_once(xs, sig, no_prompt, req), np.float32)
        rows, strip = [], []
        for i, s in enumerate(sig):
            dec_noisy = _first(pipe.vae_decode(xs[i:i + 1]))
            dec = _first(pipe.vae_decode(est[i:i + 1]))
            dec_u = _first(pipe.vae_decode(est_u[i:i + 1]))
            eff = float(np.sqrt(np.mean((est[i] - est_u[i]) ** 2)) / max(np.sqrt(np.mean(est_u[i] ** 2)), 1e-12))
            rows.append(ProbeRow(float(s), psnr(dec_noisy, orig), psnr(dec, orig), psnr(dec_u, orig), eff))
            strip.append((float(s), dec_noisy[0], dec[0]))
        result = ProbeResult(model, h, w, f, ceiling, rows)
    finally:
        if tmp is not None:
            tmp.cleanup()
    out = Path(out) if out is not None else Path("vidax-probe") / model
    out.mkdir(parents=True, exist_ok=True)
    result.files["png"] = plot(result, out / "probe.png")
    result.files["frames_png"] = frame_strip(orig[0], strip, out / "probe_frames.png")
    result.files["json"] = out / "probe.json"
    (out / "probe.json").write_text(json.dumps(result.to_json(), indent=2))
    return result


def _first(video01) -> np.ndarray:
    """[1, F, H, W, 3] -> [F, H, W, 3] (float)."""
    v = np.asarray(video01, np.float32)
    return v[0] if v.ndim == 5 else v


# ------------------------------------------------------------------ pictures (Pillow only)
_COLORS = {"psnr": (31, 119, 180), "psnr_no_prompt": (255, 127, 14), "psnr_noisy": (150, 150, 150),
           "ceiling": (44, 160, 44), "effect": (148, 103, 189)}


def _font(size):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _dashed(draw, p0, p1, color, width=2, dash=7):
    (x0, y0), (x1, y1) = p0, p1
    n = max(1, int(math.hypot(x1 - x0, y1 - y0) // dash))
    for k in range(0, n, 2):
        a, b = k / n, min((k + 1) / n, 1.0)
        draw.line([(x0 + (x1 - x0) * a, y0 + (y1 - y0) * a), (x0 + (x1 - x0) * b, y0 + (y1 - y0) * b)],
                  fill=color, width=width)


def plot(result: ProbeResult, path: Path) -> Path:
    """PSNR vs sigma (with and without the prompt, the noisy input, the VAE ceiling) above the
    prompt effect per sigma; a PNG drawn with Pillow."""
    from PIL import Image, ImageDraw

    W_, H_ = 760, 560
    im = Image.new("RGB", (W_, H_), "white")
    d = ImageDraw.Draw(im)
    f, fs = _font(15), _font(12)
    left, right, top, mid, bottom = 70, W_ - 180, 46, 360, H_ - 50
    rows = result.rows
    vals = [v for r in rows for v in (r.psnr, r.psnr_no_prompt, r.psnr_noisy) if math.isfinite(v)]
    if math.isfinite(result.vae_psnr):
        vals.append(result.vae_psnr)
    lo = 5 * math.floor(min(vals) / 5) if vals else 0
    hi = 5 * math.ceil(max(vals) / 5) if vals else 40
    hi = hi if hi > lo else lo + 5

    def X(s):
        return left + (right - left) * s

    def Y(v):
        return mid - (mid - top) * (min(max(v, lo), hi) - lo) / (hi - lo)

    d.text((left, 12), f"vidax probe: {result.model}  ({result.width}x{result.height}x{result.num_frames})",
           fill="black", font=f)
    for k in range(0, 11):  # sigma grid
        s = k / 10
        d.line([(X(s), top), (X(s), mid)], fill=(235, 235, 235))
        d.text((X(s) - 8, mid + 6), f"{s:.1f}", fill="black", font=fs)
    step = 5 if hi - lo <= 40 else 10
    for v in range(int(lo), int(hi) + 1, step):
        d.line([(left, Y(v)), (right, Y(v))], fill=(235, 235, 235))
        d.text((left - 34, Y(v) - 7), f"{v}", fill="black", font=fs)
    d.rectangle([left, top, right, mid], outline="black")
    d.text((left - 62, top - 24), "PSNR (dB)", fill="black", font=fs)
    if math.isfinite(result.vae_psnr):
        _dashed(d, (left, Y(result.vae_psnr)), (right, Y(result.vae_psnr)), _COLORS["ceiling"])
    series = [("psnr_noisy", "noisy input"), ("psnr_no_prompt", "1 step, empty prompt"), ("psnr", "1 step, prompt")]
    for key, _ in series:
        pts = [(X(r.sigma), Y(getattr(r, key))) for r in rows if math.isfinite(getattr(r, key))]
        if key == "psnr_no_prompt":
            for a, b in zip(pts, pts[1:]):
                _dashed(d, a, b, _COLORS[key], width=2)
        elif len(pts) > 1:
            d.line(pts, fill=_COLORS[key], width=3 if key == "psnr" else 2)
        for x, y in pts:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=_COLORS[key])
    ly = top + 4
    for key, label in [("ceiling", "VAE round trip")] + list(series[::-1]):
        d.line([(right + 14, ly + 7), (right + 38, ly + 7)], fill=_COLORS[key], width=3)
        d.text((right + 44, ly), label, fill="black", font=fs)
        ly += 20
    # prompt effect panel
    ptop = mid + 40
    d.text((left - 62, ptop - 20), "prompt effect (relative change of the estimate)", fill="black", font=fs)
    emax = max([r.prompt_effect for r in rows] + [1e-3])
    emax = 10 ** math.ceil(math.log10(emax)) if emax > 0 else 1.0
    d.rectangle([left, ptop, right, bottom], outline="black")
    for r in rows:
        hgt = (bottom - ptop) * min(r.prompt_effect / emax, 1.0)
        d.rectangle([X(r.sigma) - 6, bottom - hgt, X(r.sigma) + 6, bottom], fill=_COLORS["effect"])
    d.text((left - 52, ptop - 2), f"{100 * emax:g}%", fill="black", font=fs)
    d.text((left - 20, bottom - 12), "0", fill="black", font=fs)
    d.text((right - 60, bottom + 8), "sigma (noise level)", fill="black", font=fs)
    path = Path(path)
    im.save(path)
    return path


def frame_strip(original: np.ndarray, strip: list, path: Path, cell: int = 128) -> Path:
    """Original | per sigma: the noisy input above its one-step reconstruction (first frames)."""
    from PIL import Image, ImageDraw

    def tile(a):
        a = np.clip(np.round(np.asarray(a) * 255), 0, 255).astype(np.uint8)
        t = Image.fromarray(a)
        scale = cell / max(t.size)
        return t.resize((max(1, int(t.size[0] * scale)), max(1, int(t.size[1] * scale))), Image.Resampling.NEAREST)

    cols = 1 + len(strip)
    im = Image.new("RGB", (cols * (cell + 6) + 6, 2 * (cell + 22) + 6), "white")
    d = ImageDraw.Draw(im)
    fs = _font(12)
    im.paste(tile(original), (6, 22))
    d.text((6, 4), "original", fill="black", font=fs)
    for k, (s, noisy, rec) in enumerate(strip, start=1):
        x = 6 + k * (cell + 6)
        d.text((x, 4), f"sigma {s:g}", fill="black", font=fs)
        im.paste(tile(noisy), (x, 22))
        im.paste(tile(rec), (x, 22 + cell + 22))
    d.text((6, cell + 30), "noisy (top) / 1-step (bottom)", fill="black", font=fs)
    path = Path(path)
    im.save(path)
    return path


# ------------------------------------------------------------------ CLI
def add_parser(sub, model: str | None = None) -> argparse.ArgumentParser:
    from vidax import registry

    p = sub.add_parser("probe", help="low-noise reconstruction probe: PSNR of one denoising step vs noise level, "
                                     "with and without the prompt (table + PNG)")
    p.add_argument("--model", default=registry.default_model())
    p.add_argument("--preset", default="tiny")
    p.add_argument("--checkpoint", help="a real checkpoint folder (path or URL)")
    p.add_argument("--image", help="a photo (path or URL); default: a built-in test pattern")
    p.add_argument("--video", help="a clip (path); its first 4k+1 frames")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="describe the image: the conditioning check compares "
                                                            "this prompt with an empty one")
    p.add_argument("--sigmas", default=",".join(f"{s:g}" for s in DEFAULT_SIGMAS),
                   help="comma-separated noise levels in (0, 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh")
    p.add_argument("--offload-chunk-size")
    p.add_argument("--out", help="output folder (default ./vidax-probe/<model>)")
    return p


def cmd_probe(a) -> int:
    from stages.request import RequestError

    try:
        sigmas = [float(s) for s in a.sigmas.split(",") if s.strip()]
    except ValueError:
        raise RequestError("sigmas", f"{a.sigmas!r}: comma-separated numbers in (0, 1)") from None
    try:
        r = probe(a.model, preset=a.preset, checkpoint=a.checkpoint, image=a.image, video=a.video, prompt=a.prompt,
                  sigmas=sigmas, seed=a.seed, height=a.height, width=a.width, num_frames=a.frames, out=a.out,
                  dtype=a.dtype, mesh=a.mesh, offload_chunk_size=a.offload_chunk_size)
    except NotImplementedError as e:
        raise RequestError("model", str(e)) from None
    except ValueError as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError("probe", str(e)) from None
    print(r.table())
    print(f"plot: {r.files['png']}\nframes: {r.files['frames_png']}\nnumbers: {r.files['json']}")
    return 0
