"""``vidax plan`` for Cosmos-Predict2.5: the tiny preset's units hold exactly its models' weights;
the 14B DiT at the release's size is split over tp on its pool."""
import numpy as np

from stages.plan import plan
from vidax import registry
from vidax.models.cosmos import dit as cdit
from tests.refutil import mesh_axis, tree_nbytes


def test_tiny_cosmos_predict():
    p = plan("cosmos2.5-2b", preset="tiny")
    pipe = registry.get("cosmos2.5-2b").build("tiny", None)
    u = {(s.kind, m.name): m for s in p.stages for m in s.units}
    want = {("encode", "Qwen2.5-VL text encoder (all layers)"): pipe.load_text_encoder().state,
            ("sample", "DiT step"): pipe._load_dit_host()[0],
            ("decode", "VAE decode, one latent frame of one 256-px tile"): pipe.load_vae()[0]}  # tiles by default
    assert set(u) == set(want)
    for k, state in want.items():
        assert u[k].peak > 0 and u[k].weights == tree_nbytes(state), k


def test_cosmos14b_release_dit_split_over_tp():
    p = plan("cosmos2.5-14b", height=256, width=256, num_frames=9, dtype="bfloat16")
    sample = next(s for s in p.stages if s.kind == "sample")
    tp = mesh_axis(sample.mesh, "tp")
    assert tp > 1
    pipe = registry.get("cosmos2.5-14b").build(None, str(registry.get("cosmos2.5-14b").config_folder))
    total = tree_nbytes(cdit.abstract_state(pipe.dit_config(), np.dtype("bfloat16")))
    assert total > 25e9  # ~14B parameters in bf16
    w = sample.units[0].weights
    # the tp-split heads / FFN plus the replicated rest (text projection, adaLN-LoRA, norms): ~5.4%
    assert total / tp <= w < 1.07 * total / tp, (w, total, tp)
