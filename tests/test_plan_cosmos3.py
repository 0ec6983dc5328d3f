"""``vidax plan`` for Cosmos3: the tiny presets' units hold exactly their models' weights (every
weight of the MoT resident in both sample units); Nano's MoT at the release's size is split over
tp on its pool."""
import numpy as np
import pytest

from stages.plan import plan
from vidax import registry
from vidax.models.cosmos3 import mot
from tests.refutil import mesh_axis, tree_nbytes


@pytest.mark.parametrize("model", ["cosmos3-nano", "cosmos3-edge"])
def test_tiny_cosmos3(model):
    p = plan(model, preset="tiny")
    pipe = registry.get(model).build("tiny", None)
    u = {(s.kind, m.name): m for s in p.stages for m in s.units}
    dit, vae = tree_nbytes(pipe._load_host()[0]), tree_nbytes(pipe.load_vae()[0])
    # no text encoder: the encode stage tokenizes (a unit only for an image's VAE encode); Nano (720p)
    # decodes in tiles by default, Edge (480p) whole frames
    dec = "VAE decode, one latent frame" + (" of one 256-px tile" if model == "cosmos3-nano" else "")
    assert set(u) == {("sample", "text pathway (K/V cache, once per run)"), ("sample", "vision step"), ("decode", dec)}
    assert all(m.peak > 0 for m in u.values())
    assert u["sample", "vision step"].weights == u["sample", "text pathway (K/V cache, once per run)"].weights == dit
    assert u["decode", dec].weights == vae


def test_nano_release_split_over_tp():
    p = plan("cosmos3-nano", height=256, width=256, num_frames=9, dtype="bfloat16")
    sample = next(s for s in p.stages if s.kind == "sample")
    tp = mesh_axis(sample.mesh, "tp")
    assert tp > 1
    pipe = registry.get("cosmos3-nano").build(None, str(registry.get("cosmos3-nano").config_folder))
    total = tree_nbytes(mot.abstract_state(pipe.model_config(), np.dtype("bfloat16")))
    assert total > 25e9  # two ~7B pathways in bf16
    for m in sample.units:
        assert total / tp <= m.weights < 1.05 * total / tp, (m.name, m.weights, total, tp)
