"""Helpers for parity tests against the PyTorch references."""
from __future__ import annotations

import numpy as np


def perturb(module, seed: int = 0):
    """Perturb every parameter of a torch module: no zero biases, no unit norm weights.

    Returns the module (in float32, eval mode)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    module = module.float().eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if p.ndim <= 1:
                p.add_(0.1 * noise)
            else:
                s = float(p.std()) if p.numel() > 1 else 0.0
                p.add_(noise * (0.5 * s if s > 0 else 0.05))
    for name, p in module.named_parameters():
        v = p.detach()
        assert not bool((v == 0).all()), f"{name} is all zero after perturbing"
        assert not bool((v == 1).all()), f"{name} is all one after perturbing"
    return module


def assert_parity(out, ref, tol: float = 1e-4, what: str = "output"):
    """max|out - ref| <= tol * max(1, max|ref|), element-wise over the whole array."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != reference {ref.shape}"
    assert np.isfinite(out).all(), f"{what}: non-finite values"
    err = float(np.max(np.abs(out - ref))) if out.size else 0.0
    bound = tol * max(1.0, float(np.max(np.abs(ref))) if ref.size else 0.0)
    print(f"{what}: max abs err {err:.3e} (bound {bound:.3e}, max|ref| {np.max(np.abs(ref)):.3e})")
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e}"
    return err


def to_numpy(t):
    return t.detach().cpu().float().numpy()


def tree_nbytes(tree) -> int:
    """Bytes of every leaf of a tree of arrays or ``jax.ShapeDtypeStruct`` s (shape x itemsize)."""
    import jax

    return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def mesh_axis(spec: str, axis: str) -> int:
    """The size of ``axis`` in a mesh spec like ``"dp=2,tp=4"`` (1 when absent)."""
    return int(dict(kv.split("=") for kv in spec.split(",")).get(axis, 1)) if spec else 1
