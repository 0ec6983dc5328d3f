"""``vidax plan`` for CogVideoX: the tiny preset's units carry exactly its models' parameter bytes;
a release plan on its pool splits the DiT's weights over tp."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from stages.plan import plan
from tests.refutil import tree_nbytes


def test_tiny_plan_weights_are_the_models_parameters():
    from vidax.models.cogvideox import dit as cdit
    from vidax.models.cogvideox import vae as cvae
    from vidax.models.cogvideox.pipeline import CogVideoX
    from vidax.text import t5

    p = plan("cogvideox-5b", preset="tiny")
    pipe = CogVideoX("tiny-5b")
    want = {"encode": tree_nbytes(t5.init(pipe.text_config()[0]).state),
            "sample": tree_nbytes(cdit.init_state(pipe.dit_config())),
            # (the VAE's shapes from its constructor: a seeded init of its ~100 tensors takes 20 s on a CPU)
            "decode": sum(int(np.prod(a.shape)) * a.dtype.itemsize
                          for a in jax.tree.leaves(cvae.param_shapes(pipe.vae_config())))}
    assert [s.kind for s in p.stages] == ["encode", "sample", "decode"]
    for s in p.stages:
        assert s.units and all(u.peak > 0 and u.weights == want[s.kind] for u in s.units), (s.kind, s.units)


def test_release_plan_splits_the_dit_over_tp():
    """CogVideoX-2B (30 heads) on its v5e-4 sample pool with dp=2,tp=2 (short clip: compiles fast):
    each device holds half the DiT; bf16 halves it again."""
    from vidax.models.cogvideox import dit as cdit

    leaves = jax.tree_util.tree_leaves_with_path(cdit.param_shapes(cdit.PRESETS["2b"]))
    total = sum(int(np.prod(a.shape)) * 4 for _, a in leaves)
    # the adaLN modulation linears (mod1 / mod2: ~21% of the 2B) stay whole on every device (AXIS_RULES)
    mod = sum(int(np.prod(a.shape)) * 4 for k, a in leaves if "mod" in jax.tree_util.keystr(k))
    p = plan("cogvideox-2b", mesh="dp=2,tp=2", num_frames=9, height=256, width=384)
    assert p.source == "release configs"
    sample = p.stages[1]
    assert sample.mesh == "dp=2,tp=2" and sample.chips == 4 and sample.chip == "v5e"
    w = sample.units[0].weights
    assert w == pytest.approx((total - mod) / 2 + mod, rel=0.02), (w, total, mod)
    enc = p.stages[0].units[0]
    # T5-XXL (4.8B) kept in float32 (the 2B's checkpoint is float16), split over the 4-chip encode slice
    assert enc.devices == 4 and 17 * 2 ** 30 / 4 < enc.weights < 18 * 2 ** 30 / 4 * 1.02
