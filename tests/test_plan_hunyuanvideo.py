"""``vidax plan`` for HunyuanVideo 1.0: the tiny preset's units carry exactly its models' parameter
bytes; a release plan on its pool splits the DiT's blocks over tp."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from stages.plan import plan
from tests.refutil import tree_nbytes


def test_tiny_plan_weights_are_the_models_parameters():
    from vidax.models.hunyuanvideo import dit as hdit
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    p = plan("hunyuanvideo-t2v", preset="tiny")
    pipe = HunyuanVideoT2V("tiny")
    llm, clip = pipe.load_text_encoders()
    want = {"Llama text encoder": tree_nbytes(llm.state), "CLIP-L text encoder": tree_nbytes(clip.state),
            "DiT step": tree_nbytes(hdit.init_state(pipe.dit_config())),
            "VAE decode, one tile": tree_nbytes(pipe.load_vae().state)}
    assert [s.kind for s in p.stages] == ["encode", "sample", "decode"]
    units = {u.name: u for s in p.stages for u in s.units}
    assert sorted(units) == sorted(want)
    for name, u in units.items():
        assert u.peak > 0 and u.weights == want[name], name


def test_release_plan_splits_the_dit_over_tp():
    """HunyuanVideo 13B on its v5e-8 sample pool at dp=1,tp=8 (short clip: compiles fast): each
    device holds 1/8 of the block stacks; the embedders and token refiner (``embed``) and the head
    stay whole on every device (AXIS_RULES shard heads, ffn and modulation only)."""
    from vidax.models.hunyuanvideo import dit as hdit

    leaves = jax.tree_util.tree_leaves_with_path(hdit.param_shapes(hdit.PRESETS["13b"]))
    total = sum(int(np.prod(a.shape)) * 4 for _, a in leaves)
    whole = sum(int(np.prod(a.shape)) * 4 for k, a in leaves if jax.tree_util.keystr(k).startswith(("['embed']", "['head']")))
    p = plan("hunyuanvideo-t2v", num_frames=9, height=256, width=256, dtype="float32")
    assert p.source == "release configs"
    enc, sample, _ = p.stages
    assert sample.mesh == "dp=1,tp=8" and sample.chips == 8 and sample.chip == "v5e"
    assert sample.units[0].weights == pytest.approx((total - whole) / 8 + whole, rel=0.02), (total, whole)
    assert total > 50e9  # 12.8B parameters in float32
    llama = enc.units[0]
    assert llama.name == "Llama text encoder" and 3 * 2 ** 30 < llama.weights < 4 * 2 ** 30  # 8B fp32 over 8
