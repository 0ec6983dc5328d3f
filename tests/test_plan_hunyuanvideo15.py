"""``vidax plan`` for HunyuanVideo 1.5: the tiny presets' units carry exactly their models' parameter
bytes; a release plan on its pool splits the 8.3B DiT's blocks over tp."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from stages.plan import plan
from tests.refutil import mesh_axis, tree_nbytes


@pytest.mark.parametrize("model,preset", [("hunyuanvideo1.5-480p-t2v", "tiny"), ("hunyuanvideo1.5-480p-i2v", "tiny-i2v")])
def test_tiny_plan_weights_are_the_models_parameters(model, preset):
    from vidax.models.hunyuanvideo15 import dit as hdit
    from vidax.models.hunyuanvideo15.pipeline import HunyuanVideo15T2V

    p = plan(model, preset="tiny")
    pipe = HunyuanVideo15T2V(preset)
    qwen, byt5 = pipe.load_text_encoders()
    vae = tree_nbytes(pipe.load_vae().state)
    want = {"Qwen2.5-VL text encoder": tree_nbytes(qwen.state), "ByT5 glyph encoder": tree_nbytes(byt5.state),
            "DiT step": tree_nbytes(hdit.init_state(pipe.dit_config()))}
    if pipe.image_to_video:
        want |= {"SigLIP image encoder": tree_nbytes(pipe.load_image_encoder().state), "VAE image encode": vae}
    levels = len(pipe.vae_config().block_out_channels) + 2  # conv_in + mid, each up block, the output
    want |= {f"VAE decode level {i}": vae for i in range(levels)}
    assert [s.kind for s in p.stages] == ["encode", "sample", "decode"]
    units = {u.name: u for s in p.stages for u in s.units}
    assert sorted(units) == sorted(want)
    for name, u in units.items():
        assert u.peak > 0 and u.weights == want[name], name
    # the whole VAE is resident while each decoder level runs (its arguments hold every VAE weight)
    assert all(u.arguments >= vae for s in p.stages if s.kind == "decode" for u in s.units)


def test_release_plan_splits_the_dit_over_tp():
    """The 8.3B DiT on the recipe's v5e-8 sample pool (dp=2, tp=4; a short clip: compiles fast):
    each device holds 1/tp of the dual-stream blocks; the embedders (token refiner, ByT5 / image
    projections) and the head stay whole (the rules shard heads, ffn and modulation only)."""
    from vidax.models.hunyuanvideo15 import dit as hdit

    cfg = hdit.HunyuanVideo15Config(task_type="t2v", target_size=640)
    leaves = jax.tree_util.tree_leaves_with_path(hdit.param_shapes(cfg, np.float32))
    assert sum(int(np.prod(a.shape)) for _, a in leaves) == 8_326_608_160
    total = sum(int(np.prod(a.shape)) * 4 for _, a in leaves)
    whole = sum(int(np.prod(a.shape)) * 4 for k, a in leaves if jax.tree_util.keystr(k).startswith(("['embed']", "['head']")))
    p = plan("hunyuanvideo1.5-480p-t2v", num_frames=9, height=256, width=256, dtype="float32")
    assert p.source == "release configs"
    enc, sample, _ = p.stages
    tp = mesh_axis(sample.mesh, "tp")
    assert tp == 4 and sample.chips == 8 and sample.chip == "v5e"
    assert sample.units[0].weights == pytest.approx((total - whole) / tp + whole, rel=0.02), (total, whole)
    assert sample.units[0].weights == pytest.approx(total / tp, rel=0.08)
    qwen = enc.units[0]
    assert qwen.name == "Qwen2.5-VL text encoder" and qwen.devices == 8
    assert 5.5 * 2 ** 30 < qwen.weights < 6.5 * 2 ** 30  # float32 over 8: FFN and vocabulary split, the 28 / 4 heads whole


def test_release_configs_match_the_recipes():
    """Every HunyuanVideo 1.5 recipe ships its release's configs, and the recipe's defaults are
    what they say (diffusers' conversion: scheduler shift, guider scale; the step-distilled
    release's meanflow DiT), the I2V/T2V pipeline class and target size with them."""
    import json
    from pathlib import Path

    from vidax import registry

    root = Path(__file__).parents[1] / "vidax/models/hunyuanvideo15/configs"
    ids = sorted(m for m in registry.MODELS if m.startswith("hunyuanvideo1.5-"))
    assert len(ids) == 9 and sorted(p.name for p in root.iterdir()) == ids
    for m in ids:
        r, d = registry.get(m), root / m
        s = r.settings(None)
        cfg = lambda rel: json.loads((d / rel).read_text())  # noqa: E731
        assert cfg("scheduler/scheduler_config.json")["shift"] == s["shift"], m
        assert cfg("guider/guider_config.json")["guidance_scale"] == s["guidance"], m
        t = cfg("transformer/config.json")
        assert t["use_meanflow"] == m.endswith("step-distilled"), m
        assert t["task_type"] == ("i2v" if "-i2v" in m else "t2v") and t["target_size"] == (640 if "480p" in m else 960), m
        assert (cfg("model_index.json")["_class_name"] == "HunyuanVideo15ImageToVideoPipeline") == ("-i2v" in m), m
        assert s["guidance"] == (6.0 if not m.endswith("distilled") else 1.0) and s["vae_tiling"] is True, m
