"""Wan video VAE (diffusers ``AutoencoderKLWan``) in JAX: the Wan2.1 VAE, and Wan2.2's
(``is_residual=True``: residual down/up blocks with parameter-free pooling/duplicating shortcuts,
``patch_size`` 2x2 space-to-channel patchify).

Layout: the public functions (:func:`encode`, :func:`decode`, the ``*_chunk`` functions, the
latent (de)normalisation) take and return the reference layout ``[B, C, F, H, W]``; inside a chunk
program everything is channels-last, ``[B, F, H, W, C]`` (the layout changes once on the way in and
once, fused, on the way out). The cache is internal and channels-last.

Causality and chunking follow the reference exactly:

- decode runs one latent frame per chunk; the first chunk yields 1 frame, later ones
  ``cfg.temporal_ratio`` (4 for Wan2.1/2.2);
- encode runs frame 0 alone, then groups of 4 frames (frames past the last full group are dropped,
  as the reference does); each group yields ``4 / cfg.temporal_ratio`` latent frames.

Each chunk is one call of one jitted function, driven from an ordinary Python loop; ``first`` is
static, so a decode or encode of any length (and any number of them at one spatial size) uses at
most two programs. Chunks are cut on the host and passed in alone, so programs do not depend on
the video's length and no slicing program is dispatched. The temporal context is an explicit cache
pytree (a flat dict ``name -> array``, the same structure and shapes after every chunk, the first
included) passed in and returned, so a caller can persist it (:func:`cache_to_numpy`) and resume
at chunk ``k`` (``decode(..., start=k, cache=...)``):

- every causal 3x3x3 conv (and the ``(3,1,1)`` time conv of a temporal upsample) keeps the last
  two frames of its padded input. The reference starts with "no cache" (zero padding) and keeps
  one frame after the first chunk; a zero-initialised two-frame cache is the same computation, so
  the cache has one structure from the first chunk on;
- the stride-2 time conv of a temporal downsample keeps the last frame of its input.

On the first chunk the reference skips the time convs of temporal down/upsamples (and Wan2.2's
duplicating shortcut keeps only its last frame); that is what ``first`` switches.

Conv formulation (same results up to float rounding): ``conv_impl="native"`` runs the convs over
time as 3-D convs; ``"fold"`` (the default on CPU, where XLA's 2-D conv is several times faster than
its generic 3-D one) folds the time taps into the channel axis and runs 2-D convs per frame. Either
way a nearest 2x upsampling followed by a 3x3 conv runs as four 2x2 convs of the low-resolution
frames (one per output pixel phase), and 1x1 convs as matmuls.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vidax import compat
from vidax.core import nn
from vidax.core.attention import attention
from vidax.weights import KeyMap, Rule, load_checkpoint_params, open_checkpoint

# Wan2.1 latent statistics (diffusers' AutoencoderKLWan defaults).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)

ENCODE_CHUNK_FRAMES = 4  # frames per encode chunk after the first (the reference's fixed value)


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class WanVAEConfig:
    """Mirrors diffusers' ``AutoencoderKLWan`` config (field names and defaults = Wan2.1 release).

    ``in_channels`` / ``out_channels`` count channels after patchify (Wan2.2: 12 = 3 x 2 x 2); the
    video itself has ``in_channels // patch**2`` channels."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple = ()
    temperal_downsample: tuple = (False, True, True)
    dropout: float = 0.0  # inference only: unused
    latents_mean: tuple = WAN21_LATENTS_MEAN
    latents_std: tuple = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    def __post_init__(self):
        # normalise lists to tuples (hashable: the config is a static jit argument)
        for f in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, tuple):
                object.__setattr__(self, f, tuple(v))
        object.__setattr__(self, "attn_scales", tuple(float(s) for s in self.attn_scales))
        object.__setattr__(self, "temperal_downsample", tuple(bool(t) for t in self.temperal_downsample))
        if self.patch_size is not None and (int(self.patch_size) != self.patch_size or self.patch_size < 1):
            raise ValueError(f"patch_size must be None or a positive integer, got {self.patch_size!r}")
        if len(self.dim_mult) < 1:
            raise ValueError("dim_mult must not be empty")
        if len(self.temperal_downsample) < len(self.dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample has {len(self.temperal_downsample)} entries; "
                f"dim_mult {self.dim_mult} needs {len(self.dim_mult) - 1}"
            )
        if 2 ** sum(self.temperal_downsample[: len(self.dim_mult) - 1]) > ENCODE_CHUNK_FRAMES:
            raise ValueError(
                f"temperal_downsample {self.temperal_downsample}: more than 2 temporal downsamples do not fit "
                f"the reference's {ENCODE_CHUNK_FRAMES}-frame encode chunks"
            )
        if self.is_residual:  # the shortcuts fold/unfold (t, h, w) neighbourhoods into channels
            n = len(self.dim_mult)
            enc = [self.base_dim * u for u in (1, *self.dim_mult)]
            dec = [self.dec_base_dim * u for u in (self.dim_mult[-1], *self.dim_mult[::-1])]
            for i in range(n - 1):
                f_down = (2 if self.temperal_downsample[i] else 1) * 4
                f_up = (2 if self.temperal_upsample[i] else 1) * 4
                if enc[i] * f_down % enc[i + 1] or dec[i + 1] * f_up % dec[i]:
                    raise ValueError(
                        f"is_residual: level {i} channel counts do not divide evenly for the pooling/"
                        f"duplicating shortcuts (dim_mult {self.dim_mult}, base_dim {self.base_dim}, "
                        f"decoder_base_dim {self.decoder_base_dim})"
                    )
            if enc[n - 1] % enc[n]:
                raise ValueError(f"is_residual: the last encoder level's shortcut cannot average {enc[n - 1]} "
                                 f"channels down to {enc[n]}")
        if self.latents_mean is not None and len(self.latents_mean) != self.z_dim:
            warnings.warn(f"latents_mean has {len(self.latents_mean)} entries for z_dim={self.z_dim}")

    @property
    def dec_base_dim(self) -> int:
        return self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim

    @property
    def temperal_upsample(self) -> tuple:
        return tuple(self.temperal_downsample[: len(self.dim_mult) - 1][::-1])

    @property
    def temporal_ratio(self) -> int:
        return 2 ** sum(self.temperal_downsample[: len(self.dim_mult) - 1])

    @property
    def patch(self) -> int:
        return self.patch_size or 1

    @property
    def spatial_ratio(self) -> int:
        return 2 ** (len(self.dim_mult) - 1) * self.patch

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "WanVAEConfig":
        names = {f.name for f in fields(cls)}
        kw, unknown = {}, []
        for k, v in cfg.items():
            if k.startswith("_"):
                continue
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
            else:
                unknown.append(k)
        if unknown:
            warnings.warn(f"AutoencoderKLWan config: ignoring unknown fields {sorted(unknown)}")
        return cls(**kw)



def _latent_stats(cfg: WanVAEConfig, z, axis: int):
    if cfg.latents_mean is None or cfg.latents_std is None:
        raise ValueError("this VAE config has no latents_mean / latents_std")
    shape = [1] * np.ndim(z)
    shape[axis] = -1
    m = np.asarray(cfg.latents_mean, np.float32).reshape(shape)
    s = np.asarray(cfg.latents_std, np.float32).reshape(shape)
    return m, s


def normalize_latents(cfg: WanVAEConfig, z, axis: int = 1):
    """VAE latents -> the DiT's latents, ``(z - latents_mean) / latents_std`` (as the Wan pipelines do);
    channels on ``axis`` (1: the reference layout [B, C, F, H, W]; -1: channels-last)."""
    m, s = _latent_stats(cfg, z, axis)
    return ((z - m) / s).astype(z.dtype)


def denormalize_latents(cfg: WanVAEConfig, z, axis: int = 1):
    """The DiT's latents -> VAE latents, ``z * latents_std + latents_mean`` (before :func:`decode`)."""
    m, s = _latent_stats(cfg, z, axis)
    return (z * s + m).astype(z.dtype)


PRESETS = {
    "tiny": WanVAEConfig(base_dim=16, z_dim=4, dim_mult=(1, 2, 4, 4), num_res_blocks=1,
                         latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4),
    "wan2.1": WanVAEConfig(),
    # structure only: the real latents_mean/std (48 each) come with the checkpoint's config.json
    "wan2.2": WanVAEConfig(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2,
                           in_channels=12, out_channels=12, scale_factor_spatial=16,
                           latents_mean=(0.0,) * 48, latents_std=(1.0,) * 48),
}


# ----------------------------------------------------------------------------------- structure
class _Enc(NamedTuple):
    kind: str  # "res" | "attn" | "down2d" | "down3d"
    cin: int
    cout: int


class _Up(NamedTuple):
    cin: int
    cout: int
    mode: str | None  # None | "up2d" | "up3d"
    up_out: int  # channels after the upsampler


class _Down(NamedTuple):  # a Wan2.2 residual down block
    cin: int
    cout: int
    mode: str | None  # None | "down2d" | "down3d"


def _encoder_plan(cfg: WanVAEConfig) -> tuple[list[_Enc], int]:
    """The encoder's ``down_blocks`` in order (diffusers indices = list indices)."""
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    n = len(cfg.dim_mult)
    out, scale = [], 1.0
    for i in range(n):
        cin, cout = dims[i], dims[i + 1]
        for _ in range(cfg.num_res_blocks):
            out.append(_Enc("res", cin, cout))
            if scale in cfg.attn_scales:
                out.append(_Enc("attn", cout, cout))
            cin = cout
        if i != n - 1:
            out.append(_Enc("down3d" if cfg.temperal_downsample[i] else "down2d", cout, cout))
            scale /= 2.0
    return out, dims[-1]


def _residual_encoder_plan(cfg: WanVAEConfig) -> tuple[list[_Down], int]:
    """Wan2.2: ``down_blocks`` are residual blocks (num_res_blocks resnets, an optional downsampler,
    plus a parameter-free average-pooling shortcut); attn_scales is not used."""
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    n = len(cfg.dim_mult)
    out = []
    for i in range(n):
        mode = None if i == n - 1 else ("down3d" if cfg.temperal_downsample[i] else "down2d")
        out.append(_Down(dims[i], dims[i + 1], mode))
    return out, dims[-1]


def _decoder_plan(cfg: WanVAEConfig) -> tuple[list[_Up], int]:
    """The decoder's ``up_blocks`` (num_res_blocks + 1 resnets each, then an optional upsampler)."""
    d = cfg.dec_base_dim
    dims = [d * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    n = len(cfg.dim_mult)
    ups = cfg.temperal_upsample
    out = []
    for i in range(n):
        cin, cout = dims[i], dims[i + 1]
        if i > 0 and not cfg.is_residual:
            cin //= 2  # Wan2.1: the previous upsampler halves the channels
        mode = None if i == n - 1 else ("up3d" if ups[i] else "up2d")
        # Wan2.2's upsamplers keep the channel count
        out.append(_Up(cin, cout, mode, cout if cfg.is_residual or not mode else cout // 2))
    return out, dims[0]


class _P(NamedTuple):
    dst: str  # dotted vidax path
    diff: str  # diffusers name
    orig: str | None  # original-release name (None: not representable)
    kind: str  # key-map layout kind
    shape: tuple  # vidax shape
    init: str  # "w<fan_in>" | "b" | "g"


def _conv(dst, diff, orig, kernel, cin, cout, kind):
    fan = cin * int(np.prod(kernel))
    return [
        _P(f"{dst}.w", f"{diff}.weight", orig and f"{orig}.weight", kind, (*kernel, cin, cout), f"w{fan}"),
        _P(f"{dst}.b", f"{diff}.bias", orig and f"{orig}.bias", "none", (cout,), "b"),
    ]


def _gamma(dst, diff, orig, c):
    return [_P(dst, f"{diff}.gamma", orig and f"{orig}.gamma", "flat", (c,), "g")]


def _res_spec(dst, diff, orig, cin, cout):
    r = orig and f"{orig}.residual"
    s = (
        _gamma(f"{dst}.norm1", f"{diff}.norm1", r and f"{r}.0", cin)
        + _conv(f"{dst}.conv1", f"{diff}.conv1", r and f"{r}.2", (3, 3, 3), cin, cout, "conv3d")
        + _gamma(f"{dst}.norm2", f"{diff}.norm2", r and f"{r}.3", cout)
        + _conv(f"{dst}.conv2", f"{diff}.conv2", r and f"{r}.6", (3, 3, 3), cout, cout, "conv3d")
    )
    if cin != cout:
        s += _conv(f"{dst}.shortcut", f"{diff}.conv_shortcut", orig and f"{orig}.shortcut", (1, 1, 1), cin, cout, "conv3d")
    return s


def _attn_spec(dst, diff, orig, c):
    return (
        _gamma(f"{dst}.norm", f"{diff}.norm", orig and f"{orig}.norm", c)
        + _conv(f"{dst}.qkv", f"{diff}.to_qkv", orig and f"{orig}.to_qkv", (1, 1), c, 3 * c, "conv2d")
        + _conv(f"{dst}.proj", f"{diff}.proj", orig and f"{orig}.proj", (1, 1), c, c, "conv2d")
    )


def _resample_spec(dst, diff, orig, mode, c, cout):
    s = _conv(f"{dst}.conv", f"{diff}.resample.1", orig and f"{orig}.resample.1", (3, 3), c, cout, "conv2d")
    if mode == "down3d":
        s += _conv(f"{dst}.time_conv", f"{diff}.time_conv", orig and f"{orig}.time_conv", (3, 1, 1), c, c, "conv3d")
    elif mode == "up3d":
        s += _conv(f"{dst}.time_conv", f"{diff}.time_conv", orig and f"{orig}.time_conv", (3, 1, 1), c, 2 * c, "conv3d")
    return s


def _original_decoder_has_attention(cfg: WanVAEConfig) -> bool:
    # The original Decoder3d puts attention blocks in its upsamples where scale is in attn_scales
    # (scale starts at 1 / 2**(n-2) and doubles per level); diffusers' decoder never does.
    n = len(cfg.dim_mult)
    scale = 1.0 / 2 ** (n - 2)
    for _ in range(n):
        if scale in cfg.attn_scales:
            return True
        scale *= 2.0
    return False


def _spec(cfg: WanVAEConfig) -> list[_P]:
    """Every parameter: vidax path, diffusers name, original-release name, layout kind, shape."""
    s: list[_P] = []
    s += _conv("encoder.conv_in", "encoder.conv_in", "encoder.conv1", (3, 3, 3), cfg.in_channels, cfg.base_dim, "conv3d")
    if cfg.is_residual:
        blocks, enc_top = _residual_encoder_plan(cfg)
        enc = []
        for i, blk in enumerate(blocks):
            cin = blk.cin
            for r in range(cfg.num_res_blocks):
                s += _res_spec(f"encoder.down.{i}.res.{r}", f"encoder.down_blocks.{i}.resnets.{r}", None, cin, blk.cout)
                cin = blk.cout
            if blk.mode:
                s += _resample_spec(f"encoder.down.{i}.resample", f"encoder.down_blocks.{i}.downsampler", None,
                                    blk.mode, blk.cout, blk.cout)
    else:
        enc, enc_top = _encoder_plan(cfg)
    for j, layer in enumerate(enc):
        dst, diff, orig = f"encoder.down.{j}", f"encoder.down_blocks.{j}", f"encoder.downsamples.{j}"
        if layer.kind == "res":
            s += _res_spec(dst, diff, orig, layer.cin, layer.cout)
        elif layer.kind == "attn":
            s += _attn_spec(dst, diff, orig, layer.cout)
        else:
            s += _resample_spec(dst, diff, orig, layer.kind, layer.cout, layer.cout)
    s += _mid_spec("encoder", enc_top)
    s += _gamma("encoder.norm_out", "encoder.norm_out", "encoder.head.0", enc_top)
    s += _conv("encoder.conv_out", "encoder.conv_out", "encoder.head.2", (3, 3, 3), enc_top, 2 * cfg.z_dim, "conv3d")
    s += _conv("quant_conv", "quant_conv", "conv1", (1, 1, 1), 2 * cfg.z_dim, 2 * cfg.z_dim, "conv3d")
    s += _conv("post_quant_conv", "post_quant_conv", "conv2", (1, 1, 1), cfg.z_dim, cfg.z_dim, "conv3d")

    dec, dec_top = _decoder_plan(cfg)
    s += _conv("decoder.conv_in", "decoder.conv_in", "decoder.conv1", (3, 3, 3), cfg.z_dim, dec_top, "conv3d")
    s += _mid_spec("decoder", dec_top)
    flat = 0  # the original release numbers the decoder's upsamples flat
    for i, lv in enumerate(dec):
        cin = lv.cin
        for r in range(cfg.num_res_blocks + 1):
            s += _res_spec(f"decoder.up.{i}.res.{r}", f"decoder.up_blocks.{i}.resnets.{r}",
                           None if cfg.is_residual else f"decoder.upsamples.{flat}", cin, lv.cout)
            cin = lv.cout
            flat += 1
        if lv.mode:
            diff = f"decoder.up_blocks.{i}." + ("upsampler" if cfg.is_residual else "upsamplers.0")
            s += _resample_spec(f"decoder.up.{i}.resample", diff,
                                None if cfg.is_residual else f"decoder.upsamples.{flat}", lv.mode, lv.cout, lv.up_out)
            flat += 1
    s += _gamma("decoder.norm_out", "decoder.norm_out", "decoder.head.0", dec[-1].cout)
    s += _conv("decoder.conv_out", "decoder.conv_out", "decoder.head.2", (3, 3, 3), dec[-1].cout, cfg.out_channels, "conv3d")
    return s


def _mid_spec(side, c):
    return (
        _res_spec(f"{side}.mid.res0", f"{side}.mid_block.resnets.0", f"{side}.middle.0", c, c)
        + _attn_spec(f"{side}.mid.attn", f"{side}.mid_block.attentions.0", f"{side}.middle.1", c)
        + _res_spec(f"{side}.mid.res1", f"{side}.mid_block.resnets.1", f"{side}.middle.2", c, c)
    )


def _set(tree, path, value):
    keys = path.split(".")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


# ----------------------------------------------------------------------------------- params
def init_params(cfg: WanVAEConfig, seed: int = 0, dtype=np.float32):
    """Random parameters (every tensor perturbed: no zero biases, gammas around 1)."""
    ini = nn.Init(seed, dtype)
    p: dict = {}
    for e in _spec(cfg):
        if e.init == "g":
            v = ini.norm_weight(e.shape)
        elif e.init == "b":
            v = ini.bias(e.shape)
        else:
            v = ini.normal(e.shape, std=1.0 / math.sqrt(int(e.init[1:])))
        _set(p, e.dst, v)
    return p


def param_shapes(cfg: WanVAEConfig, dtype=np.float32):
    p: dict = {}
    for e in _spec(cfg):
        _set(p, e.dst, jax.ShapeDtypeStruct(e.shape, np.dtype(dtype)))
    return p


def diffusers_keymap(cfg: WanVAEConfig) -> KeyMap:
    return KeyMap([Rule(e.diff, e.dst, e.kind) for e in _spec(cfg)])


def original_keymap(cfg: WanVAEConfig) -> KeyMap:
    """Names of the original release file ``Wan2.1_VAE.pth`` (``WanVAE_`` of the Wan repository)."""
    if cfg.is_residual:
        raise NotImplementedError(
            "original_keymap: is_residual=True (Wan2.2_VAE.pth naming) is not mapped; use a diffusers folder"
        )
    if _original_decoder_has_attention(cfg):
        raise NotImplementedError(
            f"attn_scales={cfg.attn_scales}: the original Wan decoder would have attention blocks in its "
            "upsamples, which diffusers' AutoencoderKLWan (the reference ported here) does not model"
        )
    return KeyMap([Rule(e.orig, e.dst, e.kind) for e in _spec(cfg)])


# ----------------------------------------------------------------------------------- layers
CONV_IMPLS = ("fold", "native")


def _conv_impl(conv_impl: str | None) -> str:
    """How the convs over time run (see :func:`_time_conv`): ``"fold"`` (the default on CPU) or
    ``"native"`` (the default elsewhere)."""
    if conv_impl is None:
        return "fold" if jax.default_backend() == "cpu" else "native"
    if conv_impl not in CONV_IMPLS:
        raise ValueError(f"conv_impl must be one of {CONV_IMPLS} or None, got {conv_impl!r}")
    return conv_impl


class _Ctx:
    """Per-chunk trace-time state: the incoming cache (None on the first chunk) and the new one."""

    def __init__(self, old: dict | None, attn_impl, conv_impl: str = "native"):
        self.old, self.new, self.attn_impl, self.conv_impl = old, {}, attn_impl, conv_impl

    @property
    def first(self) -> bool:
        return self.old is None


def _pointwise(p, x):
    """A 1x1(x1) conv as a matmul over the channel axis (channels-last)."""
    w = p["w"]
    y = jnp.matmul(x, w.reshape(w.shape[-2], w.shape[-1]).astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
    return y + p["b"].astype(y.dtype) if "b" in p else y


def _per_frame(fn, x):
    """Apply a 2-D (``[N, H, W, C]``) function to every frame of ``x`` [B, T, H, W, C]."""
    b, t = x.shape[:2]
    y = fn(x.reshape(b * t, *x.shape[2:]))
    return y.reshape(b, t, *y.shape[1:])


def _tail(old, x, n: int):
    """The last ``n`` frames of ``[old, x]`` (concatenated on the frame axis); ``old=None``: zeros."""
    t = x.shape[1]
    if t >= n:
        return x[:, t - n:]
    if old is None:
        old = jnp.zeros((x.shape[0], n, *x.shape[2:]), x.dtype)
    return jnp.concatenate([old[:, old.shape[1] - (n - t):].astype(x.dtype), x], axis=1)


def _tap(old, x, k: int, n_old: int, span: int, stride: int):
    """Frames ``k, k + stride, ... < k + span`` of ``[old, x]`` (``old=None``: ``n_old`` zero frames),
    taken from ``old`` and ``x`` directly (the concatenation itself is never materialised)."""
    idx = range(k, k + span, stride)
    n_in_old = sum(1 for j in idx if j < n_old)
    parts = []
    if n_in_old:
        parts.append(jnp.zeros((x.shape[0], n_in_old, *x.shape[2:]), x.dtype) if old is None
                     else old[:, k: min(n_old, k + span): stride].astype(x.dtype))
    if n_in_old < len(idx):
        parts.append(x[:, idx[n_in_old] - n_old: k + span - n_old: stride])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _time_conv(ctx: _Ctx, p, old, x, stride: int = 1):
    """VALID conv over time of ``[old, x]`` (concatenated on the frame axis; ``old=None``: kt-1 zero
    frames), 'same' zero padding in space.

    ``"native"`` runs it as one 3-D conv. ``"fold"`` folds the kt time taps into the channel axis
    (one copy of the input, kt times wider) and runs one 2-D conv (a matmul for 1x1 spatial
    kernels) per frame: XLA's CPU backend has a fast 2-D conv and dot but a slow generic 3-D conv.
    With ``old=None`` the taps that only ever see the zero frames are left out."""
    kt, kh, kw, cin, cout = p["w"].shape
    sp = [(kh // 2, kh // 2), (kw // 2, kw // 2)]
    n_old = kt - 1 if old is None else old.shape[1]
    if ctx.conv_impl == "native":
        if old is None:
            return nn.conv(p, x, stride=(stride, 1, 1), padding=[(n_old, 0), *sp])
        return nn.conv(p, jnp.concatenate([old.astype(x.dtype), x], axis=1), stride=(stride, 1, 1),
                       padding=[(0, 0), *sp])
    tout = (n_old + x.shape[1] - kt) // stride + 1
    span = stride * (tout - 1) + 1
    k0 = max(0, n_old - span + 1) if old is None else 0  # taps below k0 only meet zero frames
    xs = [_tap(old, x, k, n_old, span, stride) for k in range(k0, kt)]
    xc = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=-1)  # [B, tout, H, W, (kt - k0) cin]
    w = p["w"][k0:].transpose(1, 2, 0, 3, 4).reshape(kh, kw, (kt - k0) * cin, cout)
    q = {"w": w, "b": p["b"]} if "b" in p else {"w": w}
    if kh == kw == 1:
        return _pointwise(q, xc)
    return _per_frame(lambda y: nn.conv(q, y, padding=sp), xc)


def _causal_conv(ctx: _Ctx, name: str, p, x):
    """Causal conv over time (kernel kt, cache kt-1 frames), 'same' zero padding in space."""
    kt, kh, kw = p["w"].shape[:3]
    if kt == 1:
        if kh == kw == 1:
            return _pointwise(p, x)
        return _per_frame(lambda y: nn.conv(p, y, padding=[(kh // 2, kh // 2), (kw // 2, kw // 2)]), x)
    # no cache on the first chunk: zero padding in front (= a zero-filled cache)
    old = None if ctx.first else ctx.old[name]
    ctx.new[name] = _tail(old, x, kt - 1)
    return _time_conv(ctx, p, old, x)


def _norm(gamma, x):
    return nn.l2_channel_norm(x, gamma)


def _res_block(ctx: _Ctx, name: str, p, x):
    h = _pointwise(p["shortcut"], x) if "shortcut" in p else x
    y = jax.nn.silu(_norm(p["norm1"], x))
    y = _causal_conv(ctx, f"{name}.conv1", p["conv1"], y)
    y = jax.nn.silu(_norm(p["norm2"], y))
    y = _causal_conv(ctx, f"{name}.conv2", p["conv2"], y)
    return y + h


def _attn_block(ctx: _Ctx, p, x):
    """Single-head self-attention over each frame's pixels."""
    b, t, h, w, c = x.shape
    y = _norm(p["norm"], x).reshape(b * t, h * w, c)
    qkv = _pointwise(p["qkv"], y).reshape(b * t, h * w, 3, 1, c)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    # the single head has the full channel width (384 for Wan2.1): fused kernels rarely take it
    impl = ctx.attn_impl or ("xla" if c > 128 else None)
    o = attention(q, k, v, impl=impl).reshape(b, t, h, w, c)
    return x + _pointwise(p["proj"], o)


def _downsample(ctx: _Ctx, name: str, p, x, temporal: bool):
    # ZeroPad2d((0,1,0,1)) + stride 2
    y = _per_frame(lambda f: nn.conv(p["conv"], f, stride=2, padding=[(0, 1), (0, 1)]), x)
    if not temporal:
        return y
    key = f"{name}.time_conv"
    old = None if ctx.first else ctx.old[key]
    ctx.new[key] = y[:, -1:]
    if ctx.first:
        return y  # the reference skips the time conv on the first chunk
    return _time_conv(ctx, p["time_conv"], old, y, stride=2)


def _up_taps(w, axis: int):
    """Nearest 2x upsampling then a 3-tap 'same' conv along ``axis`` = per output phase a 2-tap conv
    of the original: phase 0 sees offsets (-1, 0) with (w0, w1 + w2), phase 1 offsets (0, +1) with
    (w0 + w1, w2)."""
    w0, w1, w2 = (jax.lax.index_in_dim(w, i, axis) for i in range(3))
    return jnp.concatenate([w0, w1 + w2], axis), jnp.concatenate([w0 + w1, w2], axis)


def _upsample_conv(p, y):
    """Nearest 2x upsampling followed by the 3x3 'same' conv ``p``, on frames ``y`` [N, h, w, C], as
    four 2x2 convs of ``y`` (one per output pixel phase; 16 instead of 36 taps per input pixel, and
    no upsampled copy of the input), interleaved into [N, 2h, 2w, C']."""
    n, h, w, _ = y.shape
    rows = _up_taps(p["w"], 0)
    outs = []
    for a in range(2):
        cols = _up_taps(rows[a], 1)
        for c in range(2):
            outs.append(nn.conv({"w": cols[c]}, y, padding=[(1 - a, a), (1 - c, c)]))
    o = jnp.stack(outs).reshape(2, 2, n, h, w, -1).transpose(2, 3, 0, 4, 1, 5).reshape(n, 2 * h, 2 * w, -1)
    return o + p["b"].astype(o.dtype)


def _upsample(ctx: _Ctx, name: str, p, x, temporal: bool):
    if temporal:
        key = f"{name}.time_conv"
        if ctx.first:
            # the reference skips the time conv on the first chunk and starts the next one from zeros
            ctx.new[key] = jnp.zeros((x.shape[0], 2, *x.shape[2:]), x.dtype)
        else:
            old = ctx.old[key]
            ctx.new[key] = _tail(old, x, 2)
            y = _time_conv(ctx, p["time_conv"], old, x)  # [B, T, H, W, 2C]
            b, t, h, w, c2 = y.shape
            # channels [0, C) are each pair's first frame, [C, 2C) its second
            x = y.reshape(b, t, h, w, 2, c2 // 2).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c2 // 2)
    return _per_frame(lambda f: _upsample_conv(p["conv"], f), x)


def _avg_down(x, cout: int, ft: int, fs: int):
    """Wan2.2 ``AvgDown3D`` shortcut: fold (ft, fs, fs) neighbourhoods into channels (zero-padding time
    in front to a multiple of ft), then average groups of consecutive channels down to ``cout``."""
    b, t, h, w, c = x.shape
    pad = (-t) % ft
    if pad:
        x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    t2 = (t + pad) // ft
    x = x.reshape(b, t2, ft, h // fs, fs, w // fs, fs, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(b, t2, h // fs, w // fs, cout, c * ft * fs * fs // cout)
    return jnp.mean(x, axis=-1)


def _dup_up(x, cout: int, ft: int, fs: int, first: bool):
    """Wan2.2 ``DupUp3D`` shortcut: repeat channels, unfold them into (ft, fs, fs) neighbourhoods;
    the first chunk keeps only the last of its ft frames."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, cout * ft * fs * fs // c, axis=-1)
    x = x.reshape(b, t, h, w, cout, ft, fs, fs).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, t * ft, h * fs, w * fs, cout)
    return x[:, ft - 1:] if first else x


def patchify(x, p: int):
    """[B, F, H, W, C] -> [B, F, H/p, W/p, C p p] with the reference's channel order (c, w-offset, h-offset)."""
    if p == 1:
        return x
    b, f, h, w, c = x.shape
    if h % p or w % p:
        raise ValueError(f"height {h} and width {w} must be divisible by patch_size {p}")
    x = x.reshape(b, f, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, f, h // p, w // p, c * p * p)


def unpatchify(x, p: int):
    """Inverse of :func:`patchify`."""
    if p == 1:
        return x
    b, f, h, w, cpp = x.shape
    x = x.reshape(b, f, h, w, cpp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, f, h * p, w * p, cpp // (p * p))


def _mid(ctx: _Ctx, name: str, p, x):
    x = _res_block(ctx, f"{name}.res0", p["res0"], x)
    x = _attn_block(ctx, p["attn"], x)
    return _res_block(ctx, f"{name}.res1", p["res1"], x)


def _head(ctx: _Ctx, name: str, p, x):
    x = jax.nn.silu(_norm(p["norm_out"], x))
    return _causal_conv(ctx, f"{name}.conv_out", p["conv_out"], x)


def _encoder(cfg: WanVAEConfig, ctx: _Ctx, p, x):
    x = _causal_conv(ctx, "encoder.conv_in", p["conv_in"], x)
    if cfg.is_residual:
        for i, blk in enumerate(_residual_encoder_plan(cfg)[0]):
            q, name, x0 = p["down"][str(i)], f"encoder.down.{i}", x
            for r in range(cfg.num_res_blocks):
                x = _res_block(ctx, f"{name}.res.{r}", q["res"][str(r)], x)
            if blk.mode:
                x = _downsample(ctx, f"{name}.resample", q["resample"], x, temporal=blk.mode == "down3d")
            x = x + _avg_down(x0, blk.cout, 2 if blk.mode == "down3d" else 1, 2 if blk.mode else 1)
        plan = []
    else:
        plan = _encoder_plan(cfg)[0]
    for j, layer in enumerate(plan):
        q, name = p["down"][str(j)], f"encoder.down.{j}"
        if layer.kind == "res":
            x = _res_block(ctx, name, q, x)
        elif layer.kind == "attn":
            x = _attn_block(ctx, q, x)
        else:
            x = _downsample(ctx, name, q, x, temporal=layer.kind == "down3d")
    x = _mid(ctx, "encoder.mid", p["mid"], x)
    return _head(ctx, "encoder", p, x)


def _decoder(cfg: WanVAEConfig, ctx: _Ctx, p, x):
    x = _causal_conv(ctx, "decoder.conv_in", p["conv_in"], x)
    x = _mid(ctx, "decoder.mid", p["mid"], x)
    plan, _ = _decoder_plan(cfg)
    for i, lv in enumerate(plan):
        q, x0 = p["up"][str(i)], x
        for r in range(cfg.num_res_blocks + 1):
            x = _res_block(ctx, f"decoder.up.{i}.res.{r}", q["res"][str(r)], x)
        if lv.mode:
            x = _upsample(ctx, f"decoder.up.{i}.resample", q["resample"], x, temporal=lv.mode == "up3d")
            if cfg.is_residual:
                x = x + _dup_up(x0, lv.cout, 2 if lv.mode == "up3d" else 1, 2, ctx.first)
    return _head(ctx, "decoder", p, x)


# ----------------------------------------------------------------------------------- chunks
def _compute_dtype(params):
    return params["decoder"]["conv_in"]["w"].dtype


@partial(jax.jit, static_argnames=("cfg", "first", "attn_impl", "conv_impl"))
def _decode_chunk_jit(params, z, cache, *, cfg, first, attn_impl, conv_impl):
    ctx = _Ctx(None if first else cache, attn_impl, conv_impl)
    z = z.transpose(0, 2, 3, 4, 1).astype(_compute_dtype(params))
    x = _pointwise(params["post_quant_conv"], z)  # 1x1x1: per chunk = on the whole latent
    x = unpatchify(_decoder(cfg, ctx, params["decoder"], x), cfg.patch)
    return jnp.clip(x, -1.0, 1.0).transpose(0, 4, 1, 2, 3), ctx.new


@partial(jax.jit, static_argnames=("cfg", "first", "attn_impl", "conv_impl"))
def _encode_chunk_jit(params, x, cache, *, cfg, first, attn_impl, conv_impl):
    ctx = _Ctx(None if first else cache, attn_impl, conv_impl)
    x = patchify(x.transpose(0, 2, 3, 4, 1).astype(_compute_dtype(params)), cfg.patch)
    h = _encoder(cfg, ctx, params["encoder"], x)
    return _pointwise(params["quant_conv"], h).transpose(0, 4, 1, 2, 3), ctx.new


def _check_chunk(first, cache, frames, want_first, want_later, what):
    if not first and cache is None:
        raise ValueError(f"{what}: a chunk after the first needs the cache returned by the previous chunk")
    want = want_first if first else want_later
    if frames != want:
        raise ValueError(f"{what}: {'the first' if first else 'a later'} chunk must have {want} frame(s), got {frames}")


def _device(a):
    # host -> device without dispatching an XLA computation (one compile per program, no more)
    return jax.device_put(a) if isinstance(a, np.ndarray) else a


def decode_chunk(params, cfg: WanVAEConfig, z_chunk, cache, first: bool, *, attn_impl=None, conv_impl=None):
    """Decode one latent frame ``z_chunk`` [B, z_dim, 1, h, w] (VAE latents: denormalised).

    ``first``: whether it is the video's first latent frame (then ``cache`` is ignored and may be
    None). Returns ``(pixels [B, C, t, H, W] clamped to [-1, 1] (device array), cache)``, t = 1 for
    the first chunk and ``cfg.temporal_ratio`` after; pass the cache on to the next chunk.

    ``conv_impl``: how the convs over time run, ``"fold"`` (time taps folded into channels, 2-D
    convs: fast on CPU) or ``"native"`` (3-D convs); None: ``"fold"`` on CPU, ``"native"`` elsewhere.
    Both give the same result up to float rounding; the cache is the same either way.
    """
    _check_chunk(first, cache, z_chunk.shape[2], 1, 1, "decode_chunk")
    return _decode_chunk_jit(params, _device(z_chunk), None if first else cache,
                             cfg=cfg, first=bool(first), attn_impl=attn_impl, conv_impl=_conv_impl(conv_impl))


def encode_chunk(params, cfg: WanVAEConfig, x_chunk, cache, first: bool, *, attn_impl=None, conv_impl=None):
    """Encode one chunk of video frames ``x_chunk`` [B, C, t, H, W] (t = 1 for the first chunk, 4
    after; see :func:`encode_chunk_frames`). Returns ``(moments [B, 2 z_dim, f, h, w] (mean, then
    logvar, unclamped; device array), cache)``. ``conv_impl``: as for :func:`decode_chunk`."""
    _check_chunk(first, cache, x_chunk.shape[2], 1, ENCODE_CHUNK_FRAMES, "encode_chunk")
    return _encode_chunk_jit(params, _device(x_chunk), None if first else cache,
                             cfg=cfg, first=bool(first), attn_impl=attn_impl, conv_impl=_conv_impl(conv_impl))


def num_encode_chunks(num_frames: int) -> int:
    return 1 + (num_frames - 1) // ENCODE_CHUNK_FRAMES


def encode_chunk_frames(i: int) -> slice:
    """The frames of encode chunk ``i``."""
    return slice(0, 1) if i == 0 else slice(1 + ENCODE_CHUNK_FRAMES * (i - 1), 1 + ENCODE_CHUNK_FRAMES * i)


def decode(params, cfg: WanVAEConfig, z, *, start: int = 0, stop: int | None = None, cache=None,
           return_cache: bool = False, attn_impl=None, conv_impl=None):
    """Decode VAE latents ``z`` [B, z_dim, F, h, w] (denormalised: see :func:`denormalize_latents`) to
    pixels [B, C, T, H, W] in [-1, 1] (host numpy), T = 1 + temporal_ratio * (F - 1) for a full
    decode: ``AutoencoderKLWan.decode(z).sample``.

    Resumable: decodes latent frames ``start .. stop-1`` given the ``cache`` left by frame
    ``start - 1``; with ``return_cache`` the cache after the last decoded chunk is returned too."""
    z = np.asarray(z)  # latents are small: slice chunks on the host (no per-slice device programs)
    stop = z.shape[2] if stop is None else stop
    if start > 0 and cache is None:
        raise ValueError("decode(start > 0) needs the cache left by the previous chunk")
    outs = []
    for i in range(start, stop):
        px, cache = decode_chunk(params, cfg, z[:, :, i:i + 1], cache, first=i == 0, attn_impl=attn_impl,
                                 conv_impl=conv_impl)
        outs.append(px)
    pixels = np.concatenate([np.asarray(o) for o in outs], axis=2) if outs else None
    return (pixels, cache) if return_cache else pixels


def encode(params, cfg: WanVAEConfig, x, *, return_logvar: bool = False, attn_impl=None, conv_impl=None):
    """Encode a video ``x`` [B, C, F, H, W] (values in [-1, 1]) to the latent distribution's mean
    [B, z_dim, f, h, w] (host numpy; ``AutoencoderKLWan.encode(x).latent_dist.mean``); with
    ``return_logvar`` also its log-variance (clamped to [-30, 20] as the reference does). Frames past
    the last full chunk (``1 + 4 k``) are dropped, as in the reference."""
    x = np.asarray(x)
    cache, outs = None, []
    for i in range(num_encode_chunks(x.shape[2])):
        xc = x[:, :, encode_chunk_frames(i)]
        m, cache = encode_chunk(params, cfg, xc, cache, first=i == 0, attn_impl=attn_impl, conv_impl=conv_impl)
        outs.append(m)
    moments = np.concatenate([np.asarray(o) for o in outs], axis=2)
    mean, logvar = moments[:, : cfg.z_dim], moments[:, cfg.z_dim:]
    if return_logvar:
        return mean, np.clip(logvar, -30.0, 20.0)
    return mean


def cache_to_numpy(cache):
    """Host copy of a chunk cache (to persist between pipeline stages)."""
    return {k: np.asarray(v) for k, v in cache.items()}


def decode_cache_spec(params, cfg: WanVAEConfig, batch: int, height: int, width: int):
    """Shapes/dtypes of the decode cache for latents of spatial size (height, width); no compile."""
    dt = _compute_dtype(params)
    z = jax.ShapeDtypeStruct((batch, cfg.z_dim, 1, height, width), dt)
    fn = partial(_decode_chunk_jit, cfg=cfg, first=True, attn_impl=None, conv_impl=_conv_impl(None))
    return jax.eval_shape(fn, params, z, None)[1]


# ----------------------------------------------------------------------------------- loading
def _is_original(names) -> bool:
    return any(n.startswith(("encoder.conv1.", "decoder.head.", "encoder.downsamples.")) for n in names)


def config_from_original(ckpt) -> WanVAEConfig:
    """Infer the config from an original-format (``Wan2.1_VAE.pth``) checkpoint's tensor shapes."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    base, cin = sh["encoder.conv1.weight"][:2]
    z_dim = sh["conv2.weight"][0]
    n_down = 1 + max(int(k.split(".")[2]) for k in sh if k.startswith("encoder.downsamples."))
    levels, cur, attn_scales, temporal = [[]], None, [], []
    scale = 1.0
    for j in range(n_down):
        pre = f"encoder.downsamples.{j}."
        if pre + "residual.2.weight" in sh:
            cur = sh[pre + "residual.2.weight"][0]
            levels[-1].append(cur)
        elif pre + "to_qkv.weight" in sh:
            if scale not in attn_scales:
                attn_scales.append(scale)
        elif pre + "resample.1.weight" in sh:
            temporal.append(pre + "time_conv.weight" in sh)
            levels.append([])
            scale /= 2.0
        else:
            raise ValueError(f"original Wan VAE checkpoint: cannot tell what encoder.downsamples.{j} is")
    if any(len(lv) != len(levels[0]) for lv in levels) or any(lv[-1] % base for lv in levels):
        raise ValueError("original Wan VAE checkpoint: irregular encoder structure")
    dim_mult = tuple(lv[-1] // base for lv in levels)
    dec_top = sh["decoder.head.2.weight"][1] // dim_mult[0]
    kw = {}
    if z_dim != len(WAN21_LATENTS_MEAN):
        kw = dict(latents_mean=(0.0,) * z_dim, latents_std=(1.0,) * z_dim)
    return WanVAEConfig(
        base_dim=base, decoder_base_dim=None if dec_top == base else dec_top, z_dim=z_dim, dim_mult=dim_mult,
        num_res_blocks=len(levels[0]), attn_scales=tuple(attn_scales), temperal_downsample=tuple(temporal),
        in_channels=cin, out_channels=sh["decoder.head.2.weight"][0], **kw,
    )


def load_vae(path, cfg: WanVAEConfig | None = None, dtype=np.float32):
    """Load VAE weights from a diffusers folder (config.json + safetensors) or an original-release
    checkpoint (``Wan2.1_VAE.pth``, or a safetensors file with the same names). Returns
    ``(params, cfg)`` with host numpy params; raises ``CheckpointMismatchError`` naming any missing,
    unexpected or mis-shaped tensor."""
    path = Path(path)
    if cfg is None and path.is_dir() and (path / "config.json").exists():
        cfg = WanVAEConfig.from_diffusers(compat.read_config(path))
    return load_checkpoint_params(
        open_checkpoint(path), cfg, is_original=_is_original, config_from_original=config_from_original,
        keymap=lambda c, original: original_keymap(c) if original else diffusers_keymap(c), shapes=param_shapes, dtype=dtype,
        what=lambda c: f"AutoencoderKLWan {c}", source=path)


# ----------------------------------------------------------------------------------- compat
class _WanVAECompat(compat.CompatModel):
    """``encode(x)`` = ``vae.encode(x).latent_dist.mean``; ``decode(z)`` = ``vae.decode(z).sample``;
    both in the reference layout [B, C, F, H, W]."""

    def __init__(self, config, params, cfg):
        super().__init__("AutoencoderKLWan", config, params, cfg)

    def encode(self, x) -> np.ndarray:
        return encode(self.params, self.model_config, np.asarray(x, np.float32))

    def decode(self, z) -> np.ndarray:
        return decode(self.params, self.model_config, np.asarray(z, np.float32))


@compat.register("AutoencoderKLWan")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **_):
    params, cfg = load_vae(folder, WanVAEConfig.from_diffusers(config), dtype=dtype)
    return _WanVAECompat(config, jax.tree.map(jnp.asarray, params), cfg)
