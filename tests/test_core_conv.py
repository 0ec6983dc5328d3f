"""``vidax.core.conv.conv3d``: every formulation (per time tap, folded taps, one 3-D conv) equals
PyTorch's ``conv3d`` (float32, with a bias) over strides, paddings and kernel shapes."""
import numpy as np
import pytest

from vidax.core import conv as vconv


@pytest.mark.parametrize("kernel,strides,padding", [
    ((3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (1, 1))),  # causal in time, 'same' in space
    ((3, 3, 3), (2, 2, 2), ((0, 0), (0, 0), (0, 0))),
    ((1, 3, 3), (1, 2, 2), ((0, 0), (1, 1), (1, 1))),
    ((4, 1, 1), (2, 1, 1), ((1, 1), (0, 0), (0, 0))),
    ((1, 1, 1), (1, 1, 1), "VALID"),
    ((3, 3, 3), (1, 1, 1), "VALID"),  # run as the 'same' conv, cropped
    ((2, 3, 3), (1, 1, 1), ((1, 0), (0, 1), (0, 0))),  # partly padded, cropped unevenly
])
@pytest.mark.parametrize("impl", vconv.IMPLS)
def test_conv3d_matches_torch(kernel, strides, padding, impl):
    import torch

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 9, 10, 5)).astype(np.float32)  # [B, T, H, W, C]
    w = rng.standard_normal((*kernel, 5, 6)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    got = np.asarray(vconv.conv3d(x, w, b, strides, padding, impl=impl))
    pads = ((0, 0),) * 3 if padding == "VALID" else padding
    xt = torch.nn.functional.pad(torch.from_numpy(x).permute(0, 4, 1, 2, 3),
                                 [p for pair in reversed(pads) for p in pair])
    want = torch.nn.functional.conv3d(xt, torch.from_numpy(w).permute(4, 3, 0, 1, 2), torch.from_numpy(b),
                                      stride=strides).permute(0, 2, 3, 4, 1).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-5)


def test_conv3d_names_what_is_wrong():
    x = np.zeros((1, 2, 4, 4, 3), np.float32)
    with pytest.raises(ValueError, match=r"2 \(padded\) frames are fewer than the kernel's 3 time taps"):
        vconv.conv3d(x, np.zeros((3, 3, 3, 3, 4), np.float32), impl="taps")
    with pytest.raises(ValueError, match=r"x \(1, 2, 4, 4, 3\) .* w \(3, 3, 3, 5, 4\)"):
        vconv.conv3d(x, np.zeros((3, 3, 3, 5, 4), np.float32))
    with pytest.raises(ValueError, match="conv_impl must be one of"):
        vconv.conv3d(x, np.zeros((1, 1, 1, 3, 4), np.float32), impl="fast")


def test_default_impl_is_part_of_the_jit_key():
    """The plan compiles accelerator programs on a CPU host under ``default_impl("native")``: the
    same jitted function then lowers to one 3-D conv, and outside it to the CPU's per-tap convs,
    never a program traced under the other default."""
    import jax

    f = jax.jit(lambda x, w: vconv.conv3d(x, w))
    x, w = np.ones((1, 3, 16, 16, 4), np.float32), np.ones((3, 3, 3, 4, 12), np.float32)  # above im2col, wide
    convs = lambda: f.lower(x, w).as_text().count("stablehlo.convolution")  # noqa: E731
    assert convs() == 3  # one per time tap (this CPU's default)
    with vconv.default_impl("native"):
        assert vconv.conv_impl(None) == "native" and convs() == 1
    assert convs() == 3
    with pytest.raises(ValueError, match="conv_impl must be one of"):
        vconv.default_impl("fast")


@pytest.mark.parametrize("impl", vconv.IMPLS)
def test_kernels_split_by_time_tap(impl):
    """``split_taps`` stores every kernel of 2+ time taps as a tuple of its taps (kernels of one
    tap stay whole); ``conv3d`` of the tuple equals ``conv3d`` of the stored kernel, and the taps
    are separate program inputs (the whole kernel is not in the program, so nothing slices it)."""
    import jax
    from flax import nnx

    from vidax.core import nn

    class M(nnx.Module):
        def __init__(self):
            self.a = nnx.Module()
            self.a.kernel = nnx.Param(np.arange(3 * 3 * 3 * 4 * 9, dtype=np.float32).reshape(3, 3, 3, 4, 9) / 100)
            self.b = nnx.Module()
            self.b.kernel = nnx.Param(np.ones((1, 3, 3, 9, 9), np.float32))  # (out > NARROW_MAX_OUT: convs)

        def __call__(self, x):
            return vconv.conv3d(vconv.conv3d(x, vconv.kernel_value(self.a.kernel), impl=impl),
                                vconv.kernel_value(self.b.kernel), impl=impl)

    x = np.random.default_rng(0).standard_normal((1, 5, 20, 20, 4)).astype(np.float32)  # frames above im2col
    whole = nn.Split.of(M())
    want = np.asarray(whole(x))
    split = vconv.split_taps(nn.Split.of(M()))
    taps = vconv.kernel_value(split.merge().a.kernel)
    assert isinstance(taps, tuple) and [t.shape for t in taps] == [(3, 3, 4, 9)] * 3
    assert vconv.kernel_value(split.merge().b.kernel).shape == (1, 3, 3, 9, 9)
    assert vconv.kernel_dtype(split.merge().a.kernel) == np.float32
    np.testing.assert_allclose(np.asarray(split(x)), want, rtol=1e-6, atol=1e-5)
    if impl == "taps":
        hlo = jax.jit(lambda s, x: nnx.merge(split.graphdef, s)(x)).lower(split.state, x).as_text()
        assert "tensor<3x3x3x4x9xf32>" not in hlo  # the whole kernel is not in the program
        m = vconv.winograd_blocks(3, 3, 9, 20 * 20, 9)  # 3 output frames of 3 taps: F(3, 3), 5 frame convs
        assert hlo.count("stablehlo.convolution") == (m + 2 if m else 3) + 1


@pytest.mark.parametrize("strides,padding", [((1, 1), ((1, 1), (1, 1))), ((2, 2), ((0, 1), (1, 0))),
                                             ((1, 1), ((0, 0), (0, 0)))])
@pytest.mark.parametrize("out", [7, 3])
def test_conv2d_patch_matmul_equals_the_conv(monkeypatch, strides, padding, out):
    """Small frames convolve as one matmul of their patches (im2col); larger ones through XLA's conv,
    or with few output channels (``NARROW_MAX_OUT``, stride 1) as one matmul to every tap's outputs
    and a shifted sum: all give torch's conv2d, whichever side of the thresholds a conv falls."""
    import torch

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 9, 11, 6)).astype(np.float32)
    w = rng.standard_normal((3, 3, 6, out)).astype(np.float32)
    xt = torch.nn.functional.pad(torch.from_numpy(x).permute(0, 3, 1, 2), [*padding[1], *padding[0]])
    want = torch.nn.functional.conv2d(xt, torch.from_numpy(w).permute(3, 2, 0, 1), stride=strides).permute(0, 2, 3, 1)
    for limit in (0, 10_000):  # never / always the patch matmul
        monkeypatch.setattr(vconv, "IM2COL_MAX_PIXELS", limit)
        for narrow in (0, 8):  # never / for out <= 8 the matmul to the taps' outputs
            monkeypatch.setattr(vconv, "NARROW_MAX_OUT", narrow)
            got = np.asarray(vconv.conv2d(x, w, strides, padding))
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("rows", [1, 16, 64, 65, 300])
def test_skinny_matmuls_run_as_a_conv(monkeypatch, rows):
    """``vconv.matmul``: the product at full precision; on CPU (convs on XLA's own kernels) a matmul
    of at most ``SKINNY_MAX_ROWS`` rows is a 1x1 conv in the program, a longer one a dot; with
    ``VIDAX_CPU_CONV=ynnpack`` (no conv options) always a dot."""
    import jax

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((1, rows, 37)).astype(np.float32)
    w = rng.standard_normal((37, 23)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(vconv.matmul(x, w)), want, rtol=1e-5, atol=1e-5)
    skinny = rows <= vconv.SKINNY_MAX_ROWS and jax.default_backend() == "cpu"
    hlo = jax.jit(vconv.matmul).lower(x, w).as_text()
    assert ("stablehlo.convolution" in hlo, "stablehlo.dot_general" in hlo) == (skinny, not skinny)
    monkeypatch.setenv("VIDAX_CPU_CONV", "ynnpack")
    vconv.compiler_options.cache_clear()
    try:
        assert "stablehlo.convolution" not in jax.jit(lambda a, b: vconv.matmul(a, b)).lower(x, w).as_text()
    finally:
        monkeypatch.delenv("VIDAX_CPU_CONV")
        vconv.compiler_options.cache_clear()


@pytest.mark.parametrize("frames", [1, 2, 5])
@pytest.mark.parametrize("mode", ["zeros", "edge"])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("impl,split", [("taps", False), ("taps", True), ("native", False)])
@pytest.mark.parametrize("max_m", [0, vconv.WINOGRAD_MAX_M])
def test_causal_conv3d_equals_torch_on_the_padded_input(monkeypatch, frames, mode, cached, impl, split, max_m):
    """``causal_conv3d`` (the padded input never built) equals PyTorch's conv3d of the explicitly
    padded input: the cache frames (or the first frame repeated) before ``x`` in time, zeros or
    replicated edges in space; batch 2, so each sample's first frame is its own; and
    ``causal_tail`` is the padded input's last frames (the next chunk's cache). With and without
    Winograd over time (``max_m``)."""
    import torch

    monkeypatch.setattr(vconv, "WINOGRAD_MAX_M", max_m)
    monkeypatch.setattr(vconv, "WINOGRAD_KERNEL_PIXELS", 0)  # these small frames too
    rng = np.random.default_rng(frames)
    b, kt = 2, 3
    x = rng.standard_normal((b, frames, 6, 7, 4)).astype(np.float32)
    w = rng.standard_normal((kt, 3, 3, 4, 5)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    prev = rng.standard_normal((b, kt - 1, 6, 7, 4)).astype(np.float32) if cached else None
    wk = tuple(w) if split else w  # a kernel stored split by time tap (vconv.split_taps)
    got = np.asarray(vconv.causal_conv3d(x, wk, bias, prev, ((1, 1), (1, 1)), mode=mode, impl=impl))
    head = prev if cached else np.repeat(x[:, :1], kt - 1, axis=1)
    xp = np.concatenate([head, x], axis=1)
    xt = torch.from_numpy(xp).permute(0, 4, 1, 2, 3)
    xt = torch.nn.functional.pad(xt, [1, 1, 1, 1, 0, 0], mode="replicate" if mode == "edge" else "constant")
    want = torch.nn.functional.conv3d(xt, torch.from_numpy(w).permute(4, 3, 0, 1, 2), torch.from_numpy(bias))
    np.testing.assert_allclose(got, want.permute(0, 2, 3, 4, 1).numpy(), rtol=1e-5, atol=3e-5)
    np.testing.assert_array_equal(np.asarray(vconv.causal_tail(x, prev, kt)), xp[:, -(kt - 1):])


@pytest.mark.parametrize("frames", [1, 5, 9])
@pytest.mark.parametrize("time_pad,kt", [((2, 0), 3), ((1, 1), 3), ((2, 2), 5), ((0, 0), 3), ((3, 1), 3)])
@pytest.mark.parametrize("mode", ["zeros", "edge", "reflect"])
@pytest.mark.parametrize("impl,split", [("taps", True), ("native", False)])
@pytest.mark.parametrize("max_m", [0, vconv.WINOGRAD_MAX_M])
def test_edge_time_conv3d_equals_torch_on_the_padded_input(monkeypatch, frames, time_pad, kt, mode, impl, split,
                                                            max_m):
    """``edge_time_conv3d`` (the padded input never built) equals PyTorch's conv3d of the explicitly
    padded input: the first frame repeated ``time_pad[0]`` times and the last ``time_pad[1]`` times,
    zeros, replicated or reflected edges in space; batch 2 (each sample's frames its own). With and
    without Winograd over time (``max_m``)."""
    import torch

    monkeypatch.setattr(vconv, "WINOGRAD_MAX_M", max_m)
    monkeypatch.setattr(vconv, "WINOGRAD_KERNEL_PIXELS", 0)  # these small frames too
    if frames + sum(time_pad) < kt:
        with pytest.raises(ValueError, match="fewer than the kernel"):
            vconv.edge_time_conv3d(np.zeros((1, frames, 6, 7, 4), np.float32), np.zeros((kt, 3, 3, 4, 5), np.float32),
                                   None, time_pad, impl=impl)
        return
    rng = np.random.default_rng(frames * 7 + kt)
    b = 2
    x = rng.standard_normal((b, frames, 6, 7, 4)).astype(np.float32)
    w = rng.standard_normal((kt, 3, 3, 4, 5)).astype(np.float32)
    bias = rng.standard_normal(5).astype(np.float32)
    wk = tuple(w) if split else w
    got = np.asarray(vconv.edge_time_conv3d(x, wk, bias, time_pad, ((1, 1), (1, 1)), mode=mode, impl=impl))
    xp = np.concatenate([np.repeat(x[:, :1], time_pad[0], axis=1), x, np.repeat(x[:, -1:], time_pad[1], axis=1)], axis=1)
    xt = torch.from_numpy(xp).permute(0, 4, 1, 2, 3)
    tmode = {"zeros": "constant", "edge": "replicate", "reflect": "reflect"}[mode]
    xt = torch.nn.functional.pad(xt, [1, 1, 1, 1, 0, 0], mode=tmode)
    want = torch.nn.functional.conv3d(xt, torch.from_numpy(w).permute(4, 3, 0, 1, 2), torch.from_numpy(bias))
    np.testing.assert_allclose(got, want.permute(0, 2, 3, 4, 1).numpy(), rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("r", [2, 3, 4])
def test_winograd_matrices_compute_the_correlation(r):
    """F(m, r) from the matrices (float64): ``AT ((G g) * (BT d))`` is the correlation
    ``y_i = sum_k g_k d_{i+k}`` of random taps and inputs, for every block size the points allow;
    one point too many is refused by name."""
    rng = np.random.default_rng(r)
    for m in range(1, len(vconv._POINTS) + 3 - r):
        bt, g, at = (np.array(a) for a in vconv.winograd_matrices(m, r))
        taps, d = rng.standard_normal(r), rng.standard_normal(m + r - 1)
        want = [sum(taps[k] * d[i + k] for k in range(r)) for i in range(m)]
        np.testing.assert_allclose(at @ ((g @ taps) * (bt @ d)), want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="finite points"):
        vconv.winograd_matrices(len(vconv._POINTS) + 3 - r, r)


def test_winograd_blocks_takes_the_cheapest(monkeypatch):
    """The block size costs the least, ``ceil(T / m) (m + kt - 1)`` frame convs plus the kernels'
    combinations (``WINOGRAD_KERNEL_PIXELS`` each), and only when below the direct sum: at 64x64 px 9
    frames of 3 taps take F(3, 3) (15 frame convs, not 27) and 4 frames F(4, 3) (6, not 12); at 4x4 px,
    1 frame, 1 tap or 3 output channels never; off with ``WINOGRAD_MAX_M = 0``."""
    px = 64 * 64
    assert vconv.winograd_blocks(9, 3, 27, px, 128) == 3
    assert vconv.winograd_blocks(4, 3, 12, px, 128) == 4
    assert vconv.winograd_blocks(2, 3, 6, px, 128) == 2
    assert vconv.winograd_blocks(2, 3, 3, px, 128) == 0  # a causal conv's 2 first frames: 3 direct (repeats)
    assert vconv.winograd_blocks(1, 3, 3, px, 128) == 0
    assert vconv.winograd_blocks(9, 1, 9, px, 128) == 0
    assert vconv.winograd_blocks(9, 3, 27, px, 3) == 0
    assert vconv.winograd_blocks(4, 3, 12, 4 * 4, 512) == 0
    monkeypatch.setattr(vconv, "WINOGRAD_MAX_M", 0)
    assert vconv.winograd_blocks(9, 3, 27, px, 128) == 0


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("m", [2, 3, 4])
@pytest.mark.parametrize("kt", [3, 7])
def test_winograd_time_conv_equals_the_direct_sum(frames, m, kt):
    """Every block size over every frame count (the last block padded) gives the direct sum of the
    taps' 2-D convs (float32 rounding); batch 2, a wider output than input; 7 taps run as pieces of
    4 + 3."""
    import jax.numpy as jnp

    rng = np.random.default_rng(frames * 10 + m)
    xp = rng.standard_normal((2, frames + kt - 1, 9, 10, 4)).astype(np.float32)
    taps = [rng.standard_normal((3, 3, 4, 6)).astype(np.float32) for _ in range(kt)]
    conv = lambda f, w: vconv.conv2d(f, jnp.asarray(w), padding=((1, 1), (1, 1)))  # noqa: E731
    want = sum(np.asarray(conv(xp[:, k:k + frames].reshape(-1, 9, 10, 4), taps[k])).reshape(2, frames, 9, 10, 6)
               for k in range(kt))
    got = np.asarray(vconv.winograd_time_conv(jnp.asarray(xp), taps, m, conv))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_winograd_pieces_cover_the_taps():
    """Kernels of more than ``WINOGRAD_MAX_TAPS`` taps split into consecutive, even pieces."""
    for kt in range(1, 14):
        pieces = vconv._pieces(kt)
        assert pieces[0][0] == 0 and pieces[-1][1] == kt and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(1 <= z - a <= vconv.WINOGRAD_MAX_TAPS for a, z in pieces) and len(pieces) == -(-kt // 4)
        assert kt == 1 or min(z - a for a, z in pieces) >= 2


@pytest.mark.parametrize("k,dilation,padding", [(3, 1, (1, 1)), (3, 5, (5, 5)), (7, 3, (9, 9)), (11, 1, (5, 5)),
                                                (11, 5, (25, 25)), (7, 1, (3, 3)), (3, 1, (0, 0)), (2, 2, (0, 3))])
@pytest.mark.parametrize("max_m", [0, 4])
def test_conv1d_equals_torch(monkeypatch, k, dilation, padding, max_m):
    """``conv1d`` (dilated, zero-padded; by Winograd along the sequence in frames of ``dilation``
    samples, or XLA's conv) equals torch's conv1d, batch 2, 37 samples (no multiple of anything)."""
    import torch

    monkeypatch.setattr(vconv, "WINOGRAD_MAX_M", max_m)
    monkeypatch.setattr(vconv, "WINOGRAD_KERNEL_PIXELS", 0)
    rng = np.random.default_rng(k * 10 + dilation)
    x = rng.standard_normal((2, 37, 12)).astype(np.float32)
    w = (rng.standard_normal((k, 12, 16)) / np.sqrt(12 * k)).astype(np.float32)
    got = np.asarray(vconv.conv1d(x, w, dilation, padding))
    xt = torch.nn.functional.pad(torch.from_numpy(x).permute(0, 2, 1), list(padding))
    want = torch.nn.functional.conv1d(xt, torch.from_numpy(w).permute(2, 1, 0), dilation=dilation).permute(0, 2, 1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("padding", [((2, 0), (1, 1)), ((1, 1), (2, 0)), ((1, 1), (1, 1)), ((0, 0), (0, 0))])
@pytest.mark.parametrize("max_m", [0, 4])
def test_rows_conv2d_equals_torch(monkeypatch, padding, max_m):
    """``rows_conv2d`` (by Winograd along the rows, or ``conv2d``) equals torch's conv2d for causal
    (along either axis), centred and no padding."""
    import torch

    monkeypatch.setattr(vconv, "WINOGRAD_MAX_M", max_m)
    monkeypatch.setattr(vconv, "WINOGRAD_KERNEL_PIXELS", 0)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 13, 9, 6)).astype(np.float32)
    w = (rng.standard_normal((3, 3, 6, 10)) / 7).astype(np.float32)
    got = np.asarray(vconv.rows_conv2d(x, w, padding))
    xt = torch.nn.functional.pad(torch.from_numpy(x).permute(0, 3, 1, 2), [*padding[1], *padding[0]])
    want = torch.nn.functional.conv2d(xt, torch.from_numpy(w).permute(3, 2, 0, 1)).permute(0, 2, 3, 1)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=2e-5)


def test_space_padding_modes_are_checked():
    with pytest.raises(ValueError, match="'zeros', 'edge' or 'reflect', got 'wrap'"):
        vconv.edge_time_conv3d(np.zeros((1, 3, 6, 7, 4), np.float32), np.zeros((3, 3, 3, 4, 5), np.float32), mode="wrap")


def test_conv_programs_compile_with_their_options(monkeypatch):
    """VAE programs (``vconv.jit``) compile with :func:`vconv.compiler_options` (on CPU: convs on
    XLA's own kernels), at top level only: nested in another trace (``jax.jit``, ``eval_shape``) they
    are part of the outer program. ``VIDAX_CPU_CONV=ynnpack`` keeps XLA's default; an option the
    jaxlib rejects reaches XLA (so the option is really passed)."""
    import jax

    x = np.random.default_rng(0).standard_normal((2, 20, 20, 4)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((3, 3, 4, 5)).astype(np.float32)
    fn = lambda x, w: vconv.conv2d(x, w, padding=((1, 1), (1, 1)))  # noqa: E731
    want = np.asarray(jax.jit(fn)(x, w))
    if jax.default_backend() == "cpu":
        assert vconv.compiler_options() == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    f = vconv.jit(fn)
    np.testing.assert_allclose(np.asarray(f(x, w)), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x, w: f(x, w) * 2)(x, w)), 2 * want, rtol=1e-5, atol=1e-4)
    assert jax.eval_shape(f, x, w).shape == (2, 20, 20, 5)
    assert f.lower(x, w).compile() is not None

    monkeypatch.setattr(vconv, "compiler_options", lambda: {"xla_cpu_experimental_ynn_fusion_type": "NOT_A_TYPE"})
    with pytest.raises(Exception, match="NOT_A_TYPE"):
        vconv.jit(fn)(x, w)
    monkeypatch.undo()

    monkeypatch.setenv("VIDAX_CPU_CONV", "ynnpack")
    vconv.compiler_options.cache_clear()
    try:
        assert vconv.compiler_options() == {}
    finally:
        monkeypatch.delenv("VIDAX_CPU_CONV")
        vconv.compiler_options.cache_clear()


def test_a_conv_model_runs_its_own_programs():
    """``conv_model``: a VAE's Split with its kernels split by time tap and its calls through the
    conv programs; the same results as the plain Split."""
    from flax import nnx

    from vidax.core import nn

    class M(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(np.random.default_rng(2).standard_normal((3, 3, 3, 4, 5)).astype(np.float32) / 10)

        def __call__(self, x):
            return vconv.conv3d(x, vconv.kernel_value(self.kernel), padding=((0, 0), (1, 1), (1, 1)))

    x = np.random.default_rng(0).standard_normal((1, 5, 20, 20, 4)).astype(np.float32)
    plain = nn.Split.of(M())
    model = vconv.conv_model(nn.Split.of(M()))
    assert model.conv and not plain.conv and model._program is nn._apply_conv
    assert isinstance(vconv.kernel_value(model.merge().kernel), tuple)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(plain(x)), rtol=1e-5, atol=1e-4)


def test_stored_winograd_combinations():
    """``split_taps(combos=True)`` stores each 3-tap kernel as ``Taps`` with its Winograd
    combinations (every non-trivial row of F(2..4, 3)'s G, equal to the float64 sum); the time
    conv then reads them instead of combining taps in the program, and equals the conv of the
    whole kernel."""
    import jax
    from flax import nnx

    from vidax.core import nn

    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 3, 3, 8, 16)).astype(np.float32)

    class M(nnx.Module):
        def __init__(self):
            self.c = nnx.Module()
            self.c.kernel = nnx.Param(w.copy())

    taps = vconv.kernel_value(vconv.split_taps(nn.Split.of(M()), combos=True).merge().c.kernel)
    plain = vconv.kernel_value(vconv.split_taps(nn.Split.of(M())).merge().c.kernel)
    assert isinstance(taps, vconv.Taps) and not isinstance(plain, vconv.Taps)
    assert set(taps.combos) == set(vconv.combo_rows(3)) and len(taps.combos) == 4
    for row, c in taps.combos.items():
        np.testing.assert_allclose(np.asarray(c), np.tensordot(np.asarray(row), w.astype(np.float64), 1), rtol=1e-6,
                                   atol=1e-6)
    # the combinations survive a program boundary (a registered pytree) and are what the conv reads
    back = jax.jit(lambda t: t)(taps)
    assert isinstance(back, vconv.Taps) and set(back.combos) == set(taps.combos)
    x = rng.standard_normal((1, 3, 8, 8, 8)).astype(np.float32)
    xp = np.concatenate([x[:, :1], x, x[:, -1:]], axis=1)
    conv = lambda f, k: vconv.conv2d(f, k, padding=((1, 1), (1, 1)))  # noqa: E731

    def kernel_ops(t):  # ops of the program that make a kernel-shaped array (tap combinations)
        jaxpr = jax.make_jaxpr(lambda a, t: vconv.winograd_time_conv(a, t, 3, conv))(xp, t)
        return sum(1 for e in jaxpr.eqns for v in e.outvars if getattr(v.aval, "shape", None) == w.shape[1:])

    assert kernel_ops(plain) > 0 and kernel_ops(taps) == 0
    want = np.asarray(vconv.conv3d(xp, w, padding=((0, 0), (1, 1), (1, 1)), impl="native"))
    np.testing.assert_allclose(np.asarray(vconv.winograd_time_conv(xp, taps, 3, conv)), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(vconv.edge_time_conv3d(x, taps, None, (1, 1))), want, rtol=2e-5, atol=2e-5)
    # stored combinations make Winograd pay on small frames where combining them in the program would not
    assert vconv.winograd_blocks(3, 3, 7, 64, 512, precomputed=True) == 3
    assert vconv.winograd_blocks(3, 3, 7, 64, 512) == 0
