"""The VAE encode benchmark (`benchmarks/vae_encode.py`) times like against like: at narrow widths, each
family's two callables return the same posterior mean (the released-width cases are the same code
with the shipped configs), and `benchmarks.run` lists every family's case."""
import numpy as np
import pytest

from benchmarks import run, vae_encode


@pytest.mark.parametrize("case", vae_encode.CASES, ids=lambda c: c.__name__)
def test_both_sides_encode_the_same_clip_to_the_same_latents(case):
    c = case(narrow=True)
    ours, ref = c["vidax"](), c["reference"]()
    assert ours.shape == ref.shape and ours.shape[2:] != (1, 1, 1), ours.shape
    assert np.abs(ref).max() > 0.1  # not a degenerate (all-zero) encode
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=5e-5)


def test_every_encoding_family_is_a_benchmark_case():
    names = {f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for c in run.cases()}
    assert {f"vae_encode.vae_encode_real_width_{f}" for f in vae_encode.FAMILIES} <= names
    assert set(vae_encode.FAMILIES) == {"wan", "cogvideox", "hunyuanvideo", "hunyuanvideo15", "ltx_video_09", "ltx2_t2v"}
