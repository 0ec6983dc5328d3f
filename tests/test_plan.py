"""``vidax plan`` (stages/plan.py): per-device bytes of each stage's compiled unit at abstract
shapes, against the pool's chips; ``generate`` refusing a request that cannot fit before anything
is written, and recording the plan in the manifest."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests import sweep
from stages import cli
from stages.plan import parse_bytes, parse_pools, plan
from stages.request import RequestError
from vidax import registry
from vidax.core.plan import GiB
from tests.refutil import tree_nbytes

# every registered model that ships its release's configs (a real-size plan without a checkpoint)
REAL = sorted(m for m, r in registry.MODELS.items() if r.config_folder is not None)


def test_tiny_plan_weights_are_the_models_parameters():
    """The plan's per-stage weights equal the bytes of the very models the tiny preset builds."""
    from vidax.models.wan import dit as wdit
    from vidax.models.wan import vae as wvae
    from vidax.models.wan.pipeline import WanT2V
    from vidax.text import t5

    p = plan("wan2.1-t2v-1.3b", preset="tiny")
    pipe = WanT2V("tiny")
    want = {"encode": tree_nbytes(t5.init(pipe.text_config()).state),
            "sample": tree_nbytes(wdit.init_state(pipe.dit_config())),
            "decode": tree_nbytes(wvae.init_params(pipe.vae_config()))}
    assert [s.kind for s in p.stages] == ["encode", "sample", "decode"]
    for s in p.stages:
        (u,) = s.units
        assert u.weights == want[s.kind], s.kind
        assert u.arguments >= u.weights and u.temporaries > 0 and u.peak > u.arguments
        assert s.fits is None and s.verdict == "no limit known"  # no pool for a preset
    sample = p.stages[1].units[0]
    # guidance 5 runs conditional + unconditional as one batch of two: the output is 2 x latents
    geo = pipe.geometry()
    assert sample.outputs == 2 * 16 * geo.latent_frames(9) * (64 // 8) * (64 // 8) * 4


def test_real_plan_on_its_pool_shards_the_dit_and_names_what_does_not_fit():
    """Wan2.1 14B at 1280x720x81 on its v5e-8 pools: the DiT weights split 4 ways by tp (dp=2 for
    the guidance batch) and UMT5-XXL 8 ways over the encode slice; the float32 DiT step cannot fit a
    16 GiB chip, and the plan says so with the shortfall and the knobs; in bfloat16 it fits."""
    from vidax.models.wan import dit as wdit
    from vidax.models.wan.pipeline import UMT5_XXL
    from vidax.text import t5

    p = plan("wan2.1-t2v-14b", dtype="float32")
    assert (p.height, p.width, p.num_frames) == (720, 1280, 81) and p.source == "release configs"
    enc, sample, dec = p.stages
    assert sample.mesh == "dp=2,tp=4" and sample.chip == "v5e" and sample.hbm == 16 * GiB
    size = lambda tree: sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(tree))  # noqa: E731
    total = size(wdit.param_shapes(wdit.PRESETS["14b"]))
    w = sample.units[0].weights
    assert total / 4 <= w <= total / 4 * 1.05, (w, total)  # replicated norms/embeddings: a few %
    umt5 = size(t5.param_shapes(t5.T5Config.from_hf(UMT5_XXL)))
    assert enc.mesh == "tp=8" and umt5 / 8 <= enc.units[0].weights <= umt5 / 8 * 1.02 and enc.fits
    assert sample.fits is False and sample.shortfall == sample.peak - int(16 * GiB * 0.92) > 0
    assert any(k.startswith("--dtype bfloat16") for k in sample.knobs)
    assert any("tp=8" in k for k in sample.knobs) and any("offload" in k for k in sample.knobs)
    assert not p.fits and sample in p.failing()
    bf = plan("wan2.1-t2v-14b")  # the release's default dtype: bfloat16
    assert bf.dtype == "bfloat16"
    assert bf.stages[1].units[0].weights == pytest.approx(w / 2, rel=0.01) and bf.stages[1].fits


def test_dtype_defaults_to_the_release_s():
    """A request without --dtype: bfloat16 for the large releases' checkpoints (their float32 DiT does
    not fit the pool), float32 for the small ones and for every tiny preset; an explicit dtype wins."""
    from stages.request import Request, validate

    def dtype(model, **kw):
        return Request(model=model, prompt="x", **kw).resolved().dtype

    assert dtype("wan2.1-t2v-14b", preset=None, checkpoint="/ckpt") == "bfloat16"
    assert dtype("wan2.1-t2v-14b", preset="14b") == "bfloat16"  # a real-size preset: the release's
    assert dtype("wan2.1-t2v-1.3b", preset=None, checkpoint="/ckpt") == "float32"
    assert dtype("wan2.1-t2v-14b") == "float32"  # tiny
    assert dtype("wan2.1-t2v-14b", preset=None, checkpoint="/ckpt", dtype="float32") == "float32"
    assert validate(Request(model="wan2.1-t2v-14b", prompt="x")).dtype == "float32"
    with pytest.raises(RequestError, match="^dtype: 'float16'"):
        validate(Request(model="wan2.1-t2v-14b", prompt="x", dtype="float16"))


@pytest.mark.parametrize("model", sweep.sample(REAL, 2, "plan"))  # the pools' table is checked whole in test-all
def test_every_real_recipe_plans_on_its_pool(model):
    """At its default size and dtype, every stage of every release fits the pool it is routed to."""
    p = plan(model)
    recipe = registry.get(model)
    for s in p.stages:  # (a family without a prompt encoder, Cosmos3, has no encode unit)
        assert s.units or (s.kind == "encode" and recipe.family == "cosmos3"), (s.kind, s.units)
        assert all(u.peak > 0 and u.weights > 0 for u in s.units), (s.kind, s.units)
        pool = recipe.job_variables(s.kind, None)
        assert pool, f"{model}: no pool for its {s.kind} stage"
        assert s.chips == pool["tpu_chips"] and s.hbm is not None
        assert s.fits, f"{model} ({p.dtype}): {s.kind} needs {s.peak / GiB:.1f} GiB per {s.chip} chip"


def test_cli_plan_json_and_exit_codes(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "wan2.1-t2v-1.3b", "--preset", "tiny", "--hbm", "1GiB",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "UMT5 text encoder" in text and "fits" in text
    data = json.loads(out.read_text())
    assert data["fits"] is True and [s["stage"] for s in data["stages"]] == ["encode", "sample", "decode"]
    # too small a chip: exit 3, the failing stages and their knobs printed
    assert cli.main(["plan", "--model", "wan2.1-t2v-1.3b", "--preset", "tiny", "--hbm", "1MiB"]) == 3
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "decode:" in text
    # bad input: one line naming the field, exit 2
    assert cli.main(["plan", "--model", "wan2.1-t2v-1.3b", "--pool", "sample=v5e"]) == 2
    assert "pool" in capsys.readouterr().err


def test_parse():
    assert parse_bytes("16GiB") == 16 * GiB and parse_bytes("512MiB") == 512 * 2 ** 20 and parse_bytes("100") == 100
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert parse_pools(["sample=tpu-v5p-slice:8"]) == {"sample": ("tpu-v5p-slice", 8)}
    with pytest.raises(RequestError) as e:
        parse_pools(["render=tpu-v5p-slice:8"])
    assert e.value.field == "pool"


def test_generate_refuses_what_cannot_fit_and_records_the_plan(tmp_path, monkeypatch, capsys):
    store = tmp_path / "store"
    monkeypatch.setenv("VIDAX_DEVICE_MEMORY", "1MiB")
    assert cli.main(["generate", "--prompt", "a red fox", "--store", str(store), "--run-id", "r1"]) == 2
    err = capsys.readouterr().err
    assert "encode:" in err and "short" in err and "per device" in err
    assert not (store / "runs" / "r1").exists()  # nothing written
    monkeypatch.setenv("VIDAX_DEVICE_MEMORY", "1GiB")
    assert cli.main(["generate", "--prompt", "a red fox", "--store", str(store), "--run-id", "r1"]) == 0
    m = json.loads((store / "runs" / "r1" / "manifest.json").read_text())
    plan_rec = m["memory_plan"]
    assert plan_rec["device_memory"] == GiB and [s["stage"] for s in plan_rec["stages"]] == ["encode", "sample", "decode"]
    assert all(s["fits"] and 0 < s["peak"] < GiB for s in plan_rec["stages"])
