"""3-D convolutions of channels-last video (``[B, T, H, W, C]``, kernels ``[kt, kh, kw, in, out]``)
at full precision, formulated for the backend they run on.

XLA:CPU's generic 3-D convolution is several times slower than its 2-D one, so on CPU a
3-D conv runs as one 2-D conv per time tap (kernel ``w[k]``, a contiguous slice of the stored
kernel; input frames ``k, k + st, ...``), summed: XLA fuses the taps' sum with the bias and the
following elementwise work (``"taps"``), or with the time taps folded into the channel axis: one 2-D
conv of a kt times wider input with a transposed kernel (``"fold"``). Elsewhere it is one
``conv_general_dilated`` (``"native"``). Which is fastest depends on the widths and the frame count
(``benchmarks/``); ``"taps"`` is the CPU default. All compute the same
conv (up to float rounding). The Wan VAE's causal conv (``vidax/models/wan/vae.py``) does the same
per tap and also reads the taps that reach into its causal cache without concatenating it.

Stride-1 convs over many frames (and the rows of large 2-D frames, :func:`rows_conv2d`, and long
1-D sequences, :func:`conv1d`) run as Winograd minimal filtering along that axis
(:func:`winograd_time_conv`): F(m, kt) computes m output frames from m + kt - 1 frame convs of
combined input frames with combined taps instead of m * kt (a 3-tap conv of 4 frames: 6 instead of
12), where a cost model says the fewer convs outweigh the combinations (:func:`winograd_blocks`).
The rounding differs from the direct sum's (relative 2e-6 against 7e-7 at m = 4), the result not.

The VAEs' programs compile through :func:`jit`, which on CPU runs the 2-D convs on XLA's own
kernels instead of YNNPACK's (:func:`compiler_options`); their matmuls of a few rows (small frames'
patches, 1x1 convs of a few pixels) go the same way, as 1x1 convs (:func:`matmul`).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

_HI = jax.lax.Precision.HIGHEST
IMPLS = ("taps", "fold", "native")


def _default_state():
    """A JAX config state part of the jit key, so a program traced under one default is never
    reused under another (``jax._src.config``; a plain context variable where it is missing)."""
    try:
        from jax._src import config as jcfg

        return jcfg.enum_state("vidax_conv_impl", ["auto", *IMPLS], "auto",
                               "vidax: how 3-D convs run when a call does not say (auto: by backend)",
                               include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # noqa: BLE001 - another JAX version: no jit-key entry
        import contextlib
        import contextvars

        var = contextvars.ContextVar("vidax_conv_impl", default="auto")

        class _State:
            value = property(lambda self: var.get())

            @contextlib.contextmanager
            def __call__(self, v):
                tok = var.set(v)
                try:
                    yield
                finally:
                    var.reset(tok)

        return _State()


_DEFAULT = _default_state()


def default_impl(impl: str):
    """Context manager: 3-D convs that do not name their formulation use ``impl`` (e.g. ``"native"``
    while the plan compiles an accelerator's programs on a CPU host)."""
    if impl not in IMPLS:
        raise ValueError(f"conv_impl must be one of {IMPLS}, got {impl!r}")
    return _DEFAULT(impl)


def conv_impl(impl: str | None) -> str:
    """``impl`` checked; None: the :func:`default_impl` in force, else ``"taps"`` on CPU and
    ``"native"`` elsewhere."""
    if impl is None and _DEFAULT.value != "auto":
        impl = _DEFAULT.value
    if impl is None:
        impl = "taps" if jax.default_backend() == "cpu" else "native"
    if impl not in IMPLS:
        raise ValueError(f"conv_impl must be one of {IMPLS} or None, got {impl!r}")
    return impl


def _pairs(p, n: int):
    if isinstance(p, str):
        return ((0, 0),) * n if p == "VALID" else None
    return tuple((int(a), int(b)) for a, b in p) if len(p) == n else None


#: frames of at most this many output pixels convolve as one matmul of their patches (im2col):
#: measured on the 2-core CPU (3x3 kernels), im2col / conv = 0.1-0.2 at 4x4 px (1024 channels),
#: 0.2-0.8 at 8x8 (512-1024), about 1 at 16x16 (512), 1.5-2.5 at 32x32 (256) and above
IM2COL_MAX_PIXELS = 144

#: a conv with at most this many output channels (a VAE's last conv to RGB) runs as one matmul to
#: every tap's outputs then a shifted sum (col2im): XLA:CPU's conv runs it at ~25 GFLOP/s (3 output
#: channels); as [pixels, in] x [in, kh * kw * out] it is 3x faster (96 -> 3 at 128 px, 4 frames)
NARROW_MAX_OUT = 8


#: a matmul of at most this many rows (a small frame's patches, a 1x1 conv of a few pixels) runs as
#: a 1x1 conv, i.e. on XLA:CPU's own kernels where :func:`compiler_options` hands convs to them:
#: YNNPACK's dots of 16-32 rows run at about half their rate (2-core Xeon, [16, 4608] x [4608, 4096]:
#: 13.9 against 8.4 ms; 32 rows 21.0 against 11.1), at 64 rows on par, at 128 rows faster
SKINNY_MAX_ROWS = 64


def matmul(x, w):
    """``x [..., in] @ w [in, out]`` at full precision; at most :data:`SKINNY_MAX_ROWS` rows on a CPU
    whose convs run on XLA's own kernels: as a 1x1 conv (the same sum, their faster skinny kernel)."""
    rows, (cin, cout) = int(np.prod(x.shape[:-1])), w.shape
    if rows <= SKINNY_MAX_ROWS and compiler_options():  # (cached; {} off CPU, or VIDAX_CPU_CONV=ynnpack)
        y = jax.lax.conv_general_dilated(x.reshape(1, 1, rows, cin), w.astype(x.dtype).reshape(1, 1, cin, cout),
                                         (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=_HI)
        return y.reshape(*x.shape[:-1], cout)
    return jnp.matmul(x, w.astype(x.dtype), precision=_HI)


def conv2d(x, w, strides=(1, 1), padding=((0, 0), (0, 0))):
    """Frames ``x`` [N, H, W, in] with ``w`` [kh, kw, in, out] (no bias); 1x1 stride 1: a matmul;
    small frames (at most :data:`IM2COL_MAX_PIXELS` output pixels): one matmul of the patches; few
    output channels (at most :data:`NARROW_MAX_OUT`, stride 1): one matmul to the taps' outputs.

    A stride-1 conv whose output is smaller than its input (less than 'same' padding, e.g. VALID on
    an input padded beforehand) runs as the 'same'-padded conv with the extra border cropped: on
    XLA:CPU the 'same' conv of the same input is 3-8 times faster than the VALID one."""
    if w.shape[:2] == (1, 1) and tuple(strides) == (1, 1) and all(tuple(p) == (0, 0) for p in padding):
        return matmul(x, w[0, 0])
    (kh, kw), (sh, sw) = w.shape[:2], strides
    (p0, p1), (q0, q1) = padding
    ho, wo = (x.shape[1] + p0 + p1 - kh) // sh + 1, (x.shape[2] + q0 + q1 - kw) // sw + 1
    if ho * wo <= IM2COL_MAX_PIXELS:
        # small frames, typically wide channels: XLA:CPU's conv runs 2-10x below the matmul here
        # (4-8 px frames at 512-1024 channels); as one matmul of the frames' patches
        # ([N * ho * wo, kh * kw * in], a copy kh * kw times the small input) with the kernel
        # reshaped (free: [kh, kw, in, out] is contiguous), it runs at the matmul's rate
        xp = jnp.pad(x, ((0, 0), (p0, p1), (q0, q1), (0, 0))) if (p0, p1, q0, q1) != (0, 0, 0, 0) else x
        cols = [xp[:, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw] for i in range(kh) for j in range(kw)]
        patches = jnp.concatenate(cols, axis=-1).reshape(-1, kh * kw * x.shape[-1])
        y = matmul(patches, w.reshape(-1, w.shape[-1]))
        return y.reshape(x.shape[0], ho, wo, w.shape[-1])
    if w.shape[-1] <= NARROW_MAX_OUT and tuple(strides) == (1, 1) and min(p0, p1, q0, q1) >= 0:
        # every tap's contribution at once ([N, H, W, kh * kw, out], small: out is narrow), padded as
        # the input would be (the product is linear: a zero pixel gives zero rows), summed shifted
        n, h, wd, cin = x.shape
        z = jnp.matmul(x, w.astype(x.dtype).transpose(2, 0, 1, 3).reshape(cin, kh * kw * w.shape[-1]), precision=_HI)
        z = jnp.pad(z.reshape(n, h, wd, kh * kw, w.shape[-1]), ((0, 0), (p0, p1), (q0, q1), (0, 0), (0, 0)))
        y = None
        for i in range(kh):
            for j in range(kw):
                t = z[:, i:i + ho, j:j + wo, i * kw + j]
                y = t if y is None else y + t
        return y
    crop = None
    if tuple(strides) == (1, 1) and any(k - 1 > p0 + p1 for k, (p0, p1) in zip(w.shape[:2], padding)):
        extra = [max(0, k - 1 - p0 - p1) for k, (p0, p1) in zip(w.shape[:2], padding)]
        padding = tuple((p0 + e // 2, p1 + e - e // 2) for e, (p0, p1) in zip(extra, padding))
        crop = extra
    y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), tuple(strides), padding,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=_HI)
    if crop:
        (eh, ew), (h, wd) = crop, y.shape[1:3]
        y = y[:, eh // 2:h - (eh - eh // 2), ew // 2:wd - (ew - ew // 2)]
    return y


def rows_conv2d(x, w, padding=((0, 0), (0, 0))):
    """:func:`conv2d` (stride 1) of frames ``x`` [N, H, W, in] with ``w`` [kh, kw, in, out], by
    Winograd along the rows when that costs less (:func:`winograd_blocks`, the rows as frames of
    one row: per block of m output rows, m + kh - 1 convs of 1 x kw kernels over row combinations;
    16 row convs instead of 36 for 12 rows of a 3x3 kernel, m = 4); else :func:`conv2d`."""
    (kh, kw), ((p0, p1), (q0, q1)) = w.shape[:2], padding
    n, h, wd = x.shape[:3]
    ho, wo = h + p0 + p1 - kh + 1, wd + q0 + q1 - kw + 1
    m = winograd_blocks(ho, kh, kh * ho, wo, w.shape[-1]) if min(p0, p1, q0, q1) >= 0 else 0
    if not m:
        return conv2d(x, w, padding=padding)
    xp = jnp.pad(x, ((0, 0), (p0, p1), (0, 0), (0, 0)))[:, :, None]  # [N, rows, 1, W, in]: rows as frames
    y = winograd_time_conv(xp, [w[i][None].astype(x.dtype) for i in range(kh)], m,
                           lambda f, wk: conv2d(f, wk, padding=((0, 0), (q0, q1))))
    return y.reshape(n, ho, wo, w.shape[-1])


def conv1d(x, w, dilation: int = 1, padding=(0, 0)):
    """A stride-1 1-D conv of ``x`` [B, N, in] with ``w`` [k, in, out] (dilation ``dilation``, zero
    ``padding`` (left, right)), by Winograd along the sequence when that costs less
    (:func:`winograd_blocks`): the padded sequence read as frames of ``dilation`` samples (frame t holds
    samples t * dilation .. + dilation - 1, so the dilated taps are consecutive frames), each product
    a matmul; else XLA's conv."""
    k, (pl, pr) = w.shape[0], padding
    b, n = x.shape[:2]
    nout = n + pl + pr - dilation * (k - 1)
    frames = -(-(n + pl + pr) // dilation)  # the padded sequence in frames of `dilation` samples
    m = winograd_blocks(frames - k + 1, k, k * (frames - k + 1), dilation, w.shape[-1]) if min(pl, pr) >= 0 else 0
    if not m:
        return jax.lax.conv_general_dilated(x, w.astype(x.dtype), (1,), [(pl, pr)], rhs_dilation=(dilation,),
                                            dimension_numbers=("NWC", "WIO", "NWC"), precision=_HI)
    xp = jnp.pad(x, ((0, 0), (pl, frames * dilation - n - pl), (0, 0))).reshape(b, frames, 1, dilation, x.shape[-1])
    y = winograd_time_conv(xp, [w[i][None, None].astype(x.dtype) for i in range(k)], m, conv2d)
    return y.reshape(b, -1, w.shape[-1])[:, :nout]


def up2_taps(w, axis: int):
    """Nearest 2x upsampling then a 3-tap conv along ``axis`` of ``w`` = per output phase a 2-tap
    conv of the original: phase 0 sees offsets (-1, 0) with (w0, w1 + w2), phase 1 offsets (0, +1)
    with (w0 + w1, w2)."""
    w0, w1, w2 = (jax.lax.index_in_dim(w, i, axis) for i in range(3))
    return jnp.concatenate([w0, w1 + w2], axis), jnp.concatenate([w0 + w1, w2], axis)


def up2_conv2d(x, w):
    """Nearest 2x upsampling of frames ``x`` [N, h, w, in] followed by the 3x3 conv ``w`` [3, 3, in,
    out] with zero 'same' padding, without the upsampled copy: per output pixel phase a 2x2 conv of
    ``x`` (16 instead of 36 taps per input pixel), interleaved into [N, 2h, 2w, out] (no bias)."""
    n, h, wd, _ = x.shape
    w = w.astype(x.dtype)
    outs = []
    for a, rows in enumerate(up2_taps(w, 0)):
        for c, k in enumerate(up2_taps(rows, 1)):
            outs.append(conv2d(x, k, padding=((1 - a, a), (1 - c, c))))
    o = jnp.stack(outs).reshape(2, 2, n, h, wd, -1).transpose(2, 3, 0, 4, 1, 5)
    return o.reshape(n, 2 * h, 2 * wd, -1)


#: the most output frames per block of a time conv run as Winograd minimal filtering F(m, kt)
#: (:func:`winograd_time_conv`): m output frames from m + kt - 1 frame convs instead of m * kt.
#: Measured in float32 against the direct sum (3 taps, 3x3 kernels, unit-variance input): relative
#: error 7e-7 direct, 7e-7 / 1.6e-6 / 2.2e-6 at m = 2 / 3 / 4, 3e-5 at m = 8 (the transforms'
#: constants grow with m); 0 turns it off
WINOGRAD_MAX_M = 4
#: the interpolation points of F(m, r), in this order (stable ones first), plus the point at infinity
_POINTS = (0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5)


@functools.cache
def winograd_matrices(m: int, r: int):
    """``(BT, G, AT)`` of the Winograd / Toom-Cook correlation F(m, r) (as nested tuples of floats):
    for inputs ``d`` (n = m + r - 1) and taps ``g`` (r), ``y_i = sum_k g_k d_{i+k}`` (i < m) equals
    ``AT @ ((G @ g) * (BT @ d))``. Built from the linear convolution's evaluation at the n points
    (``_POINTS[:n - 1]`` and infinity): with Vandermonde matrices ``V_c`` (n x c), the correlation is
    the convolution's transpose, ``V_m^T diag(V_r g) V_n^-T d``; so ``BT = V_n^-T``, ``G = V_r``,
    ``AT = V_m^T``."""
    n = m + r - 1
    if m < 1 or r < 1 or n - 1 > len(_POINTS):
        raise ValueError(f"F({m}, {r}) needs {n - 1} finite points; {len(_POINTS)} are defined")

    def vander(cols: int):
        v = np.zeros((n, cols))
        for i, p in enumerate(_POINTS[:n - 1]):
            v[i] = [p ** j for j in range(cols)]
        v[n - 1, cols - 1] = 1.0  # infinity: the leading coefficient
        return v

    def exact(a):  # the entries are small rationals: zeros and ones exactly, for the combinations
        return tuple(tuple(0.0 if abs(c) < 1e-12 else float(round(c)) if abs(c - round(c)) < 1e-12 else float(c)
                           for c in row) for row in a)

    return exact(np.linalg.inv(vander(n)).T), exact(vander(r)), exact(vander(m).T)


#: what one transformed kernel of :func:`winograd_time_conv` (a combination of the taps, computed in
#: the program: memory-bound, ~10 GB/s) costs, in output pixels of one frame conv with that kernel
#: (compute-bound, ~300 GFLOP/s); both scale with the kernel's size, so this holds at any width.
#: Measured (2-core Xeon, causal 3x3x3 conv of 4 frames): 512 channels at 16x16 px F(2, 3) 40 ms
#: against 48 direct, at 4x4 px 6.8 against 5.9; 1024 channels at 4x4 px 75 against 23
WINOGRAD_KERNEL_PIXELS = 256
#: the same for a combination stored with the taps (:class:`Taps`): only read, not computed (on
#: small frames the products are bound by reading their kernels). LTX-Video 0.9 at its released
#: widths, 2x4x4 latents, in one process (2-core Xeon): 465 ms with the combinations made in the
#: program, 453 / 443 / 451 ms stored, at 0 / 32 / 64
WINOGRAD_STORED_PIXELS = 32


#: kernels of more time taps than this run as pieces of at most this many consecutive taps, each by
#: its own F(m, r) on the correspondingly shifted frames, summed (11 taps: 4 + 3 + 4, 5 products per
#: output instead of 11, with F(m, 11)'s ill-conditioned points avoided)
WINOGRAD_MAX_TAPS = 4


def _pieces(kt: int) -> list[tuple[int, int]]:
    """The tap ranges ``[a, z)`` a kernel of ``kt`` taps runs as: as few as :data:`WINOGRAD_MAX_TAPS`
    allows, as even as possible (7: 4 + 3; 9: 3 + 3 + 3; never a piece of one tap unless kt is 1)."""
    n = -(-kt // WINOGRAD_MAX_TAPS)
    cuts = [round(i * kt / n) for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _is_tap(row) -> bool:
    """Whether a row of G picks one tap as it is (no combination to make)."""
    return sorted(row) == [0.0] * (len(row) - 1) + [1.0]


def winograd_blocks(tout: int, kt: int, direct: int, pixels: int, out: int, precomputed: bool = False) -> int:
    """The block size m of F(m, kt) (:func:`winograd_time_conv`) for ``tout`` output frames of
    ``pixels`` output pixels each (one sample's: the choice, and so the rounding, never depends on
    the batch) and ``out`` channels whose cost is the least: ``ceil(tout / m) * (m + r - 1)`` frame
    convs per piece of r taps (:data:`WINOGRAD_MAX_TAPS`) plus :data:`WINOGRAD_KERNEL_PIXELS` per
    transformed kernel (:data:`WINOGRAD_STORED_PIXELS` where they are ``precomputed``: :class:`Taps`),
    if below the direct sum's ``direct`` frame convs; else 0 (small frames: the kernels'
    combinations outweigh the convs they save; few output channels: the frames')."""
    if kt < 2 or out <= NARROW_MAX_OUT:
        return 0
    best, cost = 0, direct * pixels
    for m in range(2, WINOGRAD_MAX_M + 1):
        c = 0
        for a, z in _pieces(kt):
            g = winograd_matrices(m, z - a)[1]
            made = sum(1 for row in g if not _is_tap(row))
            per_kernel = WINOGRAD_STORED_PIXELS if precomputed else WINOGRAD_KERNEL_PIXELS
            c += -(-tout // m) * (m + z - a - 1) * pixels + per_kernel * made
        if c < cost:
            best, cost = m, c
    return best


def _combine(coefs, arrays):
    """``sum_i coefs[i] * arrays[i]`` over the non-zero coefficients (a sign for +-1)."""
    y = None
    for c, a in zip(coefs, arrays):
        if c == 0:
            continue
        t = a if c == 1 else -a if c == -1 else a * c
        y = t if y is None else y + t
    return y


def winograd_time_conv(xp, taps, m: int, conv):
    """The stride-1 time conv ``y[:, t] = sum_k conv(xp[:, t + k], taps[k])`` (t < T - kt + 1) of
    frames ``xp`` [B, T, H, W, in] (padded in time as the caller needs) with its ``kt`` time taps, by
    Winograd minimal filtering along time, F(m, kt) (:func:`winograd_matrices`): per block of m
    output frames, m + kt - 1 frame convs of input frames' combinations with the taps' combinations,
    whose products combine to the m outputs (m * kt frame convs directly: 15 instead of 27 at 9
    frames, m = 3). ``conv(frames [N, H, W, in], kernel)`` -> [N, H', W', out] is one 2-D conv (any
    padding); the combinations are elementwise and fuse. The last block is padded with zero frames."""
    kt = len(taps)
    if kt > WINOGRAD_MAX_TAPS:  # pieces of consecutive taps over the correspondingly shifted frames
        tout = xp.shape[1] - kt + 1
        parts = [winograd_time_conv(xp[:, a:a + tout + z - a - 1], taps[a:z], m, conv) for a, z in _pieces(kt)]
        return functools.reduce(jnp.add, parts)
    n = m + kt - 1
    bt, g, at = winograd_matrices(m, kt)
    b, tp = xp.shape[:2]
    tout = tp - kt + 1
    blocks = -(-tout // m)
    if blocks * m + kt - 1 > tp:
        xp = jnp.pad(xp, ((0, 0), (0, blocks * m + kt - 1 - tp)) + ((0, 0),) * (xp.ndim - 2))
    d = [xp[:, i:i + m * (blocks - 1) + 1:m] for i in range(n)]  # [B, blocks, ...]: input i of each block
    prods = []
    for row_b, row_g in zip(bt, g):
        u = _combine(row_b, d)
        wk = taps.combos.get(tuple(row_g)) if isinstance(taps, Taps) else None  # made at load
        c = conv(u.reshape(b * blocks, *u.shape[2:]), _combine(row_g, taps) if wk is None else wk)
        prods.append(c.reshape(b, blocks, *c.shape[1:]))
    y = jnp.stack([_combine(row, prods) for row in at], axis=2)  # [B, blocks, m, ...]
    return y.reshape(b, blocks * m, *y.shape[3:])[:, :tout]


@jax.tree_util.register_pytree_node_class
class Taps(tuple):
    """A conv kernel's time taps (``[kh, kw, in, out]`` each: a tuple of them, as :func:`split_taps`
    stores them) with, in ``combos``, the combinations of the taps that :func:`winograd_time_conv`'s
    F(m, kt) convolves with (``combos[row] = sum_k row[k] * tap k``, every row of the G matrices of
    m = 2 .. :data:`WINOGRAD_MAX_M` that is not a tap as it is), computed once at load: in a program
    each is a memory-bound pass over all the taps (at 512 channels and 8x8 px frames about as
    long as the frame convs it saves), so with them Winograd pays wherever it needs fewer convs."""

    def __new__(cls, taps, combos=None):
        t = super().__new__(cls, taps)
        t.combos = dict(combos or {})
        return t

    def tree_flatten(self):
        rows = tuple(self.combos)
        return (*self, *(self.combos[r] for r in rows)), (len(self), rows)

    @classmethod
    def tree_unflatten(cls, aux, children):
        kt, rows = aux
        children = tuple(children)
        return cls(children[:kt], dict(zip(rows, children[kt:])))

    def astype(self, dtype):
        """The taps and combinations in ``dtype`` (no-ops where they are in it already)."""
        return Taps([t.astype(dtype) for t in self], {r: c.astype(dtype) for r, c in self.combos.items()})


def combo_rows(kt: int) -> tuple[tuple[float, ...], ...]:
    """The tap combinations (rows of G, as tuples) F(m, kt) uses for m = 2 .. :data:`WINOGRAD_MAX_M`,
    less the rows that are one tap as it is; none for kernels run as pieces (kt above
    :data:`WINOGRAD_MAX_TAPS`) or of one tap."""
    if kt < 2 or kt > WINOGRAD_MAX_TAPS:
        return ()
    rows = []
    for m in range(2, WINOGRAD_MAX_M + 1):
        for row in winograd_matrices(m, kt)[1]:
            if not _is_tap(row) and row not in rows:
                rows.append(row)
    return tuple(rows)


def _precomputed(w) -> bool:
    """Whether ``w`` carries its Winograd combinations (:class:`Taps` made with ``combos=True``)."""
    return isinstance(w, Taps) and bool(w.combos)


def _cast_taps(w, dtype):
    """The taps of ``w`` (a :class:`Taps`, list or tuple) in ``dtype``, combinations kept."""
    return w.astype(dtype) if isinstance(w, Taps) else [wk.astype(dtype) for wk in w]


def split_taps(split, min_taps: int = 2, combos: bool = False):
    """``split`` (an :class:`vidax.core.nn.Split`, or an ``nnx.State``) with every 5-D ``kernel``
    parameter of at least ``min_taps`` time taps stored as a tuple of its taps (``[kh, kw, in, out]``
    each), in place.

    A per-tap conv of a stored ``[kt, kh, kw, in, out]`` kernel makes XLA copy each slice ``w[k]``
    into its own buffer on every call (a slice of a program input is never aliased): at 512
    channels 9.4 MB per tap. Split once at load, the taps are program inputs themselves. Modules
    read such a kernel with :func:`kernel_value` and pass it to :func:`conv3d` as is. Abstract
    leaves (``jax.ShapeDtypeStruct``) split into abstract taps.

    ``combos``: where 3-D convs run per time tap (:func:`conv_impl`: CPU), each kernel is stored as
    :class:`Taps` with its Winograd combinations as well (:func:`combo_rows`: 4 for 3 taps, so such
    a kernel takes 7 / 3 of its memory); host (numpy) kernels combine in float64, device ones in
    their dtype. Elsewhere (the one native 3-D conv) they would never be read, and are not made."""
    from flax import nnx

    combos = combos and conv_impl(None) == "taps"
    for path, var in nnx.to_flat_state(getattr(split, "state", split)):
        v = var.get_value() if hasattr(var, "get_value") else var.value
        shape = tuple(getattr(v, "shape", ()))
        if path[-1] == "kernel" and len(shape) == 5 and shape[0] >= min_taps:
            rows = combo_rows(shape[0]) if combos else ()
            if isinstance(v, jax.ShapeDtypeStruct):  # an abstract state (plans, cache specs)
                taps = tuple(jax.ShapeDtypeStruct(shape[1:], v.dtype) for _ in range(shape[0]))
                made = {r: jax.ShapeDtypeStruct(shape[1:], v.dtype) for r in rows}
            elif isinstance(v, np.ndarray):
                taps = tuple(v[k] for k in range(shape[0]))
                made = {r: np.tensordot(np.asarray(r), v.astype(np.float64), 1).astype(v.dtype) for r in rows}
            else:
                taps = tuple(v[k] for k in range(shape[0]))
                made = {r: _combine(r, taps) for r in rows}
            taps = Taps(taps, made) if rows else taps
            var.set_value(taps) if hasattr(var, "set_value") else setattr(var, "value", taps)
    return split


def conv_model(split):
    """A VAE's :class:`vidax.core.nn.Split` made ready for its convolutions: kernels split by time
    tap (:func:`split_taps`), programs compiled through :func:`jit` (whose options are probed here,
    at load, not inside the first decode)."""
    compiler_options()
    return split_taps(split).replace(conv=True)


def kernel_value(var):
    """A conv kernel parameter's value: the array, or the tuple of its time taps
    (:func:`split_taps`)."""
    v = var.get_value() if hasattr(var, "get_value") else var.value
    return v if isinstance(v, (tuple, list)) else var[...]


def kernel_dtype(var):
    """The dtype of a conv kernel parameter (stored whole or split by time tap)."""
    v = kernel_value(var)
    return (v[0] if isinstance(v, (tuple, list)) else v).dtype


def conv3d(x, w, bias=None, strides=(1, 1, 1), padding=((0, 0), (0, 0), (0, 0)), *, impl: str | None = None):
    """``x`` [B, T, H, W, in] convolved with ``w`` [kt, kh, kw, in, out] (plus ``bias`` [out]):
    ``strides`` (st, sh, sw), zero ``padding`` ((t0, t1), (h0, h1), (w0, w1)) or ``"VALID"``. ``impl``: see
    :func:`conv_impl`. ``w`` may also be a sequence of its kt time taps ([kh, kw, in, out] each, as
    :func:`split_taps` stores them). Returns [B, T', H', W', out]."""
    taps = isinstance(w, (tuple, list))
    impl = conv_impl(impl)
    if taps and impl != "taps":
        w, taps = jnp.stack(w), False
    if taps:
        w = _cast_taps(w, x.dtype)
    strides = tuple(int(s) for s in strides)
    padding = _pairs(padding, 3)
    wshape = (len(w), *w[0].shape) if taps else w.shape
    if len(strides) != 3 or padding is None or x.ndim != 5 or len(wshape) != 5 or x.shape[-1] != wshape[3]:
        raise ValueError(f"conv3d: x {tuple(x.shape)} [B, T, H, W, in] and w {tuple(wshape)} [kt, kh, kw, in, "
                         f"out] with 3 strides and 3 padding pairs, got strides {strides}, padding {padding}")
    if impl == "native":
        y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), strides, padding,
                                         dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision=_HI)
    else:
        if padding[0] != (0, 0):
            x = jnp.pad(x, ((0, 0), padding[0], (0, 0), (0, 0), (0, 0)))
        kt, st = wshape[0], strides[0]
        b, t = x.shape[:2]
        tout = (t - kt) // st + 1
        if tout < 1:
            raise ValueError(f"conv3d: {t} (padded) frames are fewer than the kernel's {kt} time taps")
        m = (winograd_blocks(tout, kt, kt * tout, x.shape[2] * x.shape[3] // (strides[1] * strides[2]), wshape[-1],
                             _precomputed(w))
             if impl == "taps" and st == 1 else 0)
        if m:
            y = winograd_time_conv(x, w, m, lambda f, wk: conv2d(f, wk, strides[1:], padding[1:]))
            return y if bias is None else y + bias.astype(y.dtype)
        xs = [x[:, k:k + st * (tout - 1) + 1:st] for k in range(kt)]  # the frames tap k meets
        if impl == "fold":
            xs = [jnp.concatenate(xs, axis=-1)] if kt > 1 else xs
            ws = [w.transpose(1, 2, 0, 3, 4).reshape(*w.shape[1:3], kt * w.shape[3], w.shape[4])]
        else:
            ws = list(w)
        y = None
        for xk, wk in zip(xs, ws):
            yk = conv2d(xk.reshape(b * tout, *xk.shape[2:]), wk, strides[1:], padding[1:])
            y = yk if y is None else y + yk
        y = y.reshape(b, tout, *y.shape[1:])
    return y if bias is None else y + bias.astype(y.dtype)


def causal_conv3d(x, w, bias=None, prev=None, padding=((1, 1), (1, 1)), *, mode: str = "zeros",
                  impl: str | None = None):
    """A causal 3-D conv (stride 1) of ``x`` [B, T, H, W, in] with ``w`` [kt, kh, kw, in, out] (or its
    time taps): output frame t sees padded frames t .. t + kt - 1 of ``prev`` + ``x``, where ``prev``
    [B, kt - 1, H, W, in] are the frames before ``x`` (a causal cache) or, None, ``x``'s first frame
    repeated (replicate padding in time: :func:`edge_time_conv3d`). ``padding`` in space, zeros or
    (``mode="edge"`` / ``"reflect"``) by ``jnp.pad`` of that mode. Returns [B, T, H', W', out]; the new
    cache (the last kt - 1 padded frames) is :func:`causal_tail`.

    Per time tap (``"taps"``) the padded input is never built: with ``prev``, tap k convolves its
    kt - 1 - k cache frames and the first T - (kt - 1 - k) of ``x`` (one copy)."""
    taps = isinstance(w, (tuple, list))
    kt = len(w) if taps else w.shape[0]
    if prev is None:
        return edge_time_conv3d(x, w, bias, (kt - 1, 0), padding, mode=mode, impl=impl)
    b, t = x.shape[:2]
    impl = conv_impl(impl)
    if impl != "taps" or kt == 1:
        xp = jnp.concatenate([prev.astype(x.dtype), x], axis=1) if kt > 1 else x
        return edge_time_conv3d(xp, w, bias, (0, 0), padding, mode=mode, impl=impl)
    if m := winograd_blocks(t, kt, kt * t, x.shape[2] * x.shape[3], (w[0] if taps else w).shape[-1], _precomputed(w)):
        xp = jnp.concatenate([prev.astype(x.dtype), x], axis=1)
        return _winograd_space(xp, w, bias, m, padding, mode)
    frames, conv = _space_padded(padding, mode)
    y = None
    for k, wk in enumerate(w if taps else list(w)):
        lead = kt - 1 - k  # padded frames before x that this tap meets at output frame 0
        xk = x if lead == 0 else jnp.concatenate([prev[:, k:].astype(x.dtype), x[:, :max(t - lead, 0)]], axis=1)[:, :t]
        c = conv(frames(xk), wk.astype(x.dtype))
        c = c.reshape(b, t, *c.shape[1:])
        y = c if y is None else y + c
    return y if bias is None else y + bias.astype(y.dtype)


def _winograd_space(xp, w, bias, m: int, padding, mode: str):
    """:func:`winograd_time_conv` of the time-padded frames ``xp`` with the taps of ``w``, padded in
    space by ``padding`` of ``mode`` (as :func:`causal_conv3d`), plus ``bias``."""
    if _explicit(mode):
        xp = jnp.pad(xp, ((0, 0), (0, 0), *padding, (0, 0)), mode=mode)
        padding = ((0, 0), (0, 0))
    y = winograd_time_conv(xp, _cast_taps(w, xp.dtype), m, lambda f, wk: conv2d(f, wk, padding=padding))
    return y if bias is None else y + bias.astype(y.dtype)


def _explicit(mode: str) -> bool:
    """Whether space padding ``mode`` is applied by ``jnp.pad`` (edge, reflect) rather than the conv (zeros)."""
    if mode not in ("zeros", "edge", "reflect"):
        raise ValueError(f"space padding mode must be 'zeros', 'edge' or 'reflect', got {mode!r}")
    return mode != "zeros"


def _space_padded(padding, mode: str):
    """``(frames, conv)`` for the per-tap convs of :func:`edge_time_conv3d` / :func:`causal_conv3d`:
    ``frames`` [B, n, H, W, in] -> [B * n, H', W', in], padded in space here unless ``mode`` is
    ``"zeros"`` (then the conv pads); ``conv(frames, tap)``."""
    explicit = _explicit(mode)
    pads = ((0, 0), (0, 0)) if explicit else padding

    def frames(f):
        f = jnp.pad(f, ((0, 0), (0, 0), *padding, (0, 0)), mode=mode) if explicit else f
        return f.reshape(-1, *f.shape[2:])

    return frames, lambda f4, wk: conv2d(f4, wk, padding=pads)


def edge_time_conv3d(x, w, bias=None, time_pad=(2, 0), padding=((1, 1), (1, 1)), *, mode: str = "zeros",
                     impl: str | None = None):
    """A stride-1 3-D conv of ``x`` [B, T, H, W, in] with ``w`` [kt, kh, kw, in, out] (or its time
    taps) whose time axis is padded by repeating the first frame ``time_pad[0]`` times and the last
    ``time_pad[1]`` times (``(kt - 1, 0)``: causal; ``((kt - 1) // 2,) * 2``: centred). ``padding`` in
    space, zeros or (``mode="edge"`` / ``"reflect"``) by ``jnp.pad`` of that mode. Returns
    [B, T + sum(time_pad) - kt + 1, H', W', out].

    Per time tap (``"taps"``) the padded input is never built: tap k convolves each frame of ``x`` it
    meets once, and the output frames that meet a repeat of the first or last frame take that
    frame's output (broadcast inside the taps' sum): T + (kt - 1) * kt / 2 fewer frame convs than the
    padded form for a causal conv (3 of 27 at T = 9)."""
    taps = isinstance(w, (tuple, list))
    kt = len(w) if taps else w.shape[0]
    (p0, p1), (b, t) = time_pad, x.shape[:2]
    tout = t + p0 + p1 - kt + 1
    if tout < 1:
        raise ValueError(f"edge_time_conv3d: {t} frames padded by {time_pad} are fewer than the kernel's {kt} taps")
    impl = conv_impl(impl)
    explicit = _explicit(mode)
    if impl != "taps" or kt == 1:
        parts = [jnp.repeat(x[:, :1], p0, axis=1)] * bool(p0) + [x] + [jnp.repeat(x[:, -1:], p1, axis=1)] * bool(p1)
        xp = jnp.concatenate(parts, axis=1) if len(parts) > 1 else x
        if explicit:
            xp = jnp.pad(xp, ((0, 0), (0, 0), *padding, (0, 0)), mode=mode)
        return conv3d(xp, w, bias, (1, 1, 1), ((0, 0), *(((0, 0), (0, 0)) if explicit else padding)), impl=impl)
    spans = [(min(max(k - p0, 0), t - 1), min(max(tout - 1 + k - p0, 0), t - 1)) for k in range(kt)]
    if m := winograd_blocks(tout, kt, sum(z - a + 1 for a, z in spans), x.shape[2] * x.shape[3],
                            (w[0] if taps else w).shape[-1], _precomputed(w)):  # the padded input, built
        parts = [jnp.repeat(x[:, :1], p0, axis=1)] * bool(p0) + [x] + [jnp.repeat(x[:, -1:], p1, axis=1)] * bool(p1)
        return _winograd_space(jnp.concatenate(parts, axis=1) if len(parts) > 1 else x, w, bias, m, padding, mode)
    pads = ((0, 0), (0, 0)) if explicit else padding
    if explicit:  # padded in space once, for every tap
        x = jnp.pad(x, ((0, 0), (0, 0), *padding, (0, 0)), mode=mode)
    x4 = x.reshape(b * t, *x.shape[2:])  # one sample: the frames a tap meets are a slice of these
    y = None
    for k, wk in enumerate(w if taps else list(w)):
        # output frame o reads frame clip(o + k - p0, 0, T - 1) of x: frames a .. z, each once
        a, z = spans[k]
        n = z - a + 1
        xk = x4[a:z + 1] if b == 1 else x[:, a:z + 1].reshape(-1, *x.shape[2:])
        c = conv2d(xk, wk.astype(x.dtype), padding=pads)
        c = c.reshape(b, n, *c.shape[1:])
        if n == 1:
            c = jnp.broadcast_to(c, (b, tout, *c.shape[2:]))
        else:
            front, back = min(tout, a - k + p0 + 1) - 1, tout - max(0, z - k + p0) - 1  # repeats of a, z
            parts = ([jnp.broadcast_to(c[:, :1], (b, front, *c.shape[2:]))] * bool(front) + [c]
                     + [jnp.broadcast_to(c[:, -1:], (b, back, *c.shape[2:]))] * bool(back))
            c = jnp.concatenate(parts, axis=1) if len(parts) > 1 else c
        y = c if y is None else y + c
    return y if bias is None else y + bias.astype(y.dtype)


def causal_tail(x, prev, kt: int):
    """The last ``kt - 1`` frames of :func:`causal_conv3d`'s padded input (the next call's ``prev``)."""
    if kt <= 1:
        return x[:, :0]
    t = x.shape[1]
    if t >= kt - 1:
        return x[:, t - (kt - 1):]
    head = jnp.repeat(x[:, :1], kt - 1, axis=1) if prev is None else prev.astype(x.dtype)
    return jnp.concatenate([head, x], axis=1)[:, -(kt - 1):]


#: XLA:CPU (jaxlib 0.10) hands convolutions and dots to YNNPACK; with the dots alone, the convs run
#: on XLA's own (Eigen) kernels: a VAE's 3x3 taps at 96 / 192 / 384 channels 268 / 322 / 368
#: GFLOP/s against 179 / 234 / 327 through YNNPACK, the released-width decodes of Wan, CogVideoX,
#: HunyuanVideo 1.0 / 1.5 9-13% faster, LTX's (small frames: im2col matmuls) unchanged
#: (2-core Xeon, README "VAE decodes at the released widths"). ``VIDAX_CPU_CONV=ynnpack`` keeps XLA's default.
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def compiler_options() -> dict:
    """The XLA options convolution programs compile with: on CPU (unless ``VIDAX_CPU_CONV=ynnpack``)
    convs on XLA's own kernels, dots on YNNPACK; none elsewhere, nor where this jaxlib does not know
    the option (checked once by compiling a tiny program)."""
    from vidax.core.runtime import check_settings

    check_settings()  # VIDAX_CPU_CONV is xla or ynnpack (a library caller may never run runtime.setup)
    if jax.default_backend() != "cpu" or os.environ.get("VIDAX_CPU_CONV", "xla") == "ynnpack":
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=_CPU_OPTIONS).lower(jnp.zeros(1)).compile()
    except Exception:  # an older or newer jaxlib without this option: XLA's default
        return {}
    return dict(_CPU_OPTIONS)


class _ConvJit:
    """``jax.jit(fun, **kw)`` compiled with :func:`compiler_options`, made at first use (the backend
    is known then, and importing a module does not start one)."""

    def __init__(self, fun, kw):
        self._fun, self._kw = fun, kw
        functools.update_wrapper(self, fun)

    @functools.cached_property
    def _jitted(self):
        return jax.jit(self._fun, compiler_options=compiler_options() or None, **self._kw)

    @functools.cached_property
    def _nested(self):  # inside another trace (jit, eval_shape, shard_map): the outer program's options
        return jax.jit(self._fun, **self._kw)

    def __call__(self, *args, **kwargs):
        traced = any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves((args, kwargs)))
        return (self._nested if traced else self._jitted)(*args, **kwargs)

    def __getattr__(self, name):  # lower, eval_shape, trace, clear_cache, ...
        if name.startswith("__") or name in ("_fun", "_kw"):
            raise AttributeError(name)
        return getattr(self._jitted, name)


def jit(fun=None, **kw):
    """``jax.jit`` for programs made of convolutions (a VAE's decode / encode units), with
    :func:`compiler_options`; also a decorator factory: ``@vconv.jit(static_argnames=...)``."""
    if fun is None:
        return lambda f: _ConvJit(f, kw)
    return _ConvJit(fun, kw)


def silu(x):
    """SiLU as ``x / (1 + exp(-x))``, for the activation feeding a conv: its last op is a division,
    which XLA:CPU does not duplicate into the activation's consumers. With ``x * sigmoid(x)`` it
    materialises the sigmoid and re-fuses the cheap rest (the norm, scale / shift, the multiply) into
    every consumer (each tap's input copy, the cache, the conv), each re-reading the norm's inputs."""
    return x / (1 + jnp.exp(-x))


def activation(name: str):
    """:func:`silu` for ``"silu"``, else ``vidax.core.nn.activation(name)``."""
    from vidax.core import nn

    return silu if name == "silu" else nn.activation(name)
