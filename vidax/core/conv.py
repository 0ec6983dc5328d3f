"""3-D convolutions of channels-last video (``[B, T, H, W, C]``, kernels ``[kt, kh, kw, in, out]``)
at full precision, formulated for the backend they run on.

XLA:CPU's generic 3-D convolution is several times slower than its 2-D one (YNNPACK), so on CPU a
3-D conv runs as one 2-D conv per time tap (kernel ``w[k]``, a contiguous slice of the stored
kernel; input frames ``k, k + st, ...``), summed: XLA fuses the taps' sum with the bias and the
following elementwise work (``"taps"``), or with the time taps folded into the channel axis: one 2-D
conv of a kt times wider input with a transposed kernel (``"fold"``). Elsewhere it is one
``conv_general_dilated`` (``"native"``). Which is fastest depends on the widths and the frame count
(``benchmarks/``); ``"taps"`` is the CPU default. All compute the same
conv (up to float rounding). The Wan VAE's causal conv (``vidax/models/wan/vae.py``) does the same
per tap and also reads the taps that reach into its causal cache without concatenating it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

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


def conv2d(x, w, strides=(1, 1), padding=((0, 0), (0, 0))):
    """Frames ``x`` [N, H, W, in] with ``w`` [kh, kw, in, out] (no bias); 1x1 stride 1: a matmul.

    A stride-1 conv whose output is smaller than its input (less than 'same' padding, e.g. VALID on
    an input padded beforehand) runs as the 'same'-padded conv with the extra border cropped: on
    XLA:CPU the 'same' conv of the same input is 3-8 times faster than the VALID one."""
    if w.shape[:2] == (1, 1) and tuple(strides) == (1, 1) and all(tuple(p) == (0, 0) for p in padding):
        return jnp.matmul(x, w[0, 0].astype(x.dtype), precision=_HI)
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


def conv3d(x, w, bias=None, strides=(1, 1, 1), padding=((0, 0), (0, 0), (0, 0)), *, impl: str | None = None):
    """``x`` [B, T, H, W, in] convolved with ``w`` [kt, kh, kw, in, out] (plus ``bias`` [out]):
    ``strides`` (st, sh, sw), zero ``padding`` ((t0, t1), (h0, h1), (w0, w1)) or ``"VALID"``. ``impl``: see
    :func:`conv_impl`. Returns [B, T', H', W', out]."""
    strides = tuple(int(s) for s in strides)
    padding = _pairs(padding, 3)
    if len(strides) != 3 or padding is None or x.ndim != 5 or w.ndim != 5 or x.shape[-1] != w.shape[3]:
        raise ValueError(f"conv3d: x {tuple(x.shape)} [B, T, H, W, in] and w {tuple(w.shape)} [kt, kh, kw, in, "
                         f"out] with 3 strides and 3 padding pairs, got strides {strides}, padding {padding}")
    impl = conv_impl(impl)
    if impl == "native":
        y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), strides, padding,
                                         dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision=_HI)
    else:
        if padding[0] != (0, 0):
            x = jnp.pad(x, ((0, 0), padding[0], (0, 0), (0, 0), (0, 0)))
        kt, st = w.shape[0], strides[0]
        b, t = x.shape[:2]
        tout = (t - kt) // st + 1
        if tout < 1:
            raise ValueError(f"conv3d: {t} (padded) frames are fewer than the kernel's {kt} time taps")
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
