"""``vidax plan`` for LTX: the tiny presets' units hold exactly their models' weights; LTX-2's DiT
at the release's size is split over tp on its pool."""
import jax
import numpy as np
import pytest

from stages.plan import plan
from vidax import registry
from vidax.models.ltx import dit2 as ldit2


def nbytes(tree) -> int:
    return sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def units(p) -> dict:
    return {(s.kind, u.name): u for s in p.stages for u in s.units}


@pytest.mark.parametrize("model", ["ltx-video-0.9", "ltx-video-0.9-i2v"])
def test_tiny_ltx_video(model):
    p = plan(model, preset="tiny")
    pipe = registry.get(model).build("tiny", None)
    u = units(p)
    assert {k for k, _ in u} == {"encode", "sample", "decode"}
    assert all(m.peak > 0 for m in u.values())
    assert u["encode", "T5 text encoder"].weights == nbytes(pipe.load_text_encoder().state)
    assert u["sample", "DiT step"].weights == nbytes(pipe.load_dit()[0])
    assert u["decode", "VAE decode, whole clip"].weights == nbytes(pipe.load_vae()[0])


def test_tiny_ltx2():
    p = plan("ltx2-t2v", preset="tiny")
    pipe = registry.get("ltx2-t2v").build("tiny", None)
    u = units(p)
    avae, _, voc = pipe.load_audio()
    want = {("encode", "Gemma 3 text encoder (all layers)"): pipe.load_text_encoder().state,
            ("encode", "text connectors"): pipe.load_connectors().state,
            ("sample", "DiT step (video + audio)"): pipe.load_dit()[0],
            ("decode", "VAE decode, one spatial tile"): pipe.load_vae()[0],
            ("decode", "audio VAE decode"): avae.state, ("decode", "vocoder"): voc.state}
    assert set(u) == set(want)
    for k, state in want.items():
        assert u[k].peak > 0 and u[k].weights == nbytes(state), k


def test_ltx2_release_dit_split_over_tp():
    """LTX-2's 19B DiT at its released size (small frames: the weights do not depend on them) on
    its pool's mesh: each device holds about the whole DiT's bytes / tp."""
    p = plan("ltx2-t2v", height=256, width=256, num_frames=9, dtype="bfloat16")
    sample = next(s for s in p.stages if s.kind == "sample")
    tp = dict(kv.split("=") for kv in sample.mesh.split(","))["tp"]
    pipe = registry.get("ltx2-t2v").build(None, str(registry.get("ltx2-t2v").config_folder))
    total = nbytes(ldit2.abstract_state(pipe.dit_config(), np.dtype("bfloat16")))
    assert total > 35e9  # ~19B parameters in bf16
    w = sample.units[0].weights
    # the tp-split blocks plus the replicated rest (adaLN tables, caption projections, norms): ~5.5%
    assert total / int(tp) <= w < 1.07 * total / int(tp), (w, total, tp)
