"""Attention kernels: which implementation each backend and dtype gets, Pallas splash attention
(interpret mode on CPU) against the dense reference at odd lengths, key masks and padded head
dims, splash inside shard_map under Ulysses sequence parallelism, and the real recipes' attention
shapes traced through the splash path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vidax.core import attention as A


def _qkv(b, lq, lk, h, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((b, n, h, d)).astype(np.float32)) for n in (lq, lk, lk))


@pytest.mark.parametrize("backend,dtype,bias,mask,want", [
    ("tpu", jnp.float32, False, None, "splash"),
    ("tpu", jnp.bfloat16, False, "key", "splash"),
    ("tpu", jnp.float32, False, "query", "xla"),  # a query-dependent mask stays dense
    ("tpu", jnp.float32, True, None, "xla"),  # an additive bias stays dense
    ("gpu", jnp.bfloat16, False, None, "cudnn"),
    ("gpu", jnp.float32, False, None, "xla"),  # float32 on GPU: the dense path at full precision
    ("cpu", jnp.float32, False, None, "xla"),
])
def test_selection(monkeypatch, backend, dtype, bias, mask, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    q = jnp.zeros((2, 10, 4, 64), dtype)
    m = {None: None, "key": jnp.ones((2, 1, 1, 10), bool), "query": jnp.ones((2, 1, 10, 10), bool)}[mask]
    assert A._resolve(None, q, jnp.zeros((1,)) if bias else None, m) == want
    assert A._resolve("xla", q, None, None) == "xla"
    with pytest.raises(ValueError):
        A._resolve("fast", q, None, None)


def test_block_table():
    assert A.splash_blocks(75_600, 75_600, "TPU v5 lite") == (512, 1024, 512)
    assert A.splash_blocks(32_760, 512, "TPU v5p") == (512, 512, 512)  # text keys: one 512 block
    assert A.splash_blocks(100, 257, "TPU v6 lite") == (128, 384, 384)  # short: multiples of 128
    assert A.splash_blocks(4096, 4096, "some chip") == A.SPLASH_BLOCKS["default"]


@pytest.mark.parametrize("lq,lk,d,masked", [(100, 100, 16, False), (100, 77, 12, False), (130, 257, 32, True),
                                             (5, 3, 8, True)])
def test_splash_matches_dense(lq, lk, d, masked):
    """Odd lengths (padded to the block size, padding masked), head dims below 128 lanes (padded),
    per-sample key masks (different valid lengths per row), a non-default scale."""
    q, k, v = _qkv(2, lq, lk, 3, d, seed=lq)
    mask = None
    if masked:
        valid = np.arange(lk)[None] < np.array([[lk], [max(1, lk // 3)]])
        mask = jnp.asarray(valid[:, None, None, :])
    got = A.attention(q, k, v, mask=mask, scale=0.7 / np.sqrt(d), impl="splash")
    want = A.dense_attention(q, k, v, mask=mask, scale=0.7 / np.sqrt(d))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="key masks"):
        A.attention(q, k, v, mask=jnp.ones((2, 1, lq, lk), bool), impl="splash")


def test_splash_inside_shard_map_with_sequence_parallelism():
    """The Wan DiT on a dp x sp mesh (Ulysses all-to-all around every self-attention) with splash
    attention equals the dense path."""
    from vidax.models.wan import dit as wdit

    cfg = wdit.PRESETS["tiny"]
    state = wdit.init_state(cfg, seed=3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 6, 12, cfg.in_channels)).astype(np.float32))  # 54 tokens
    t = jnp.asarray([900.0, 20.0])
    ctx = jnp.asarray(rng.standard_normal((2, 7, cfg.text_dim)).astype(np.float32))
    dense = wdit.runner(state, cfg, "dp=2,sp=2", attn_impl="xla")(x, t, ctx)
    splash = wdit.runner(state, cfg, "dp=2,sp=2", attn_impl="splash")(x, t, ctx)
    np.testing.assert_allclose(np.asarray(splash), np.asarray(dense), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,lq,lk,heads", [
    ("Wan 480x832x81 self-attention", 32_760, 32_760, 40),
    ("Wan 720x1280x81 self-attention", 75_600, 75_600, 40),
    ("Wan I2V CLIP image tokens", 32_760, 257, 40),
    ("Wan text cross-attention", 75_600, 512, 40),
])
def test_real_shapes_trace(name, lq, lk, heads):
    """The lengths the legacy flash kernel rejected trace through splash (shapes only)."""
    s = lambda n: jax.ShapeDtypeStruct((1, n, heads, 128), jnp.bfloat16)  # noqa: E731
    out = jax.eval_shape(lambda q, k, v: A.splash_attention(q, k, v, interpret=False, device_kind="TPU v5 lite"),
                         s(lq), s(lk), s(lk))
    assert out.shape == (1, lq, heads, 128) and out.dtype == jnp.bfloat16, name
