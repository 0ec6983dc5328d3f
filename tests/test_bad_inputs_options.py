"""Bad input gets a clear error and loses nothing: family options, meshes, prompts, images and
clips that used to pass validation and fail later (or fail with a wall of text).

Each refused case: exit code 2, one line ``vidax: error: <field>: ...`` on stderr, and a store that
is byte-identical before and after (it already holds a finished run)."""

import numpy as np
import pytest

from stages import cli
from stages.prompts import parse_prompt_file
from stages.request import Request, RequestError, validate
from tests.test_bad_inputs import tree_digest
from vidax import registry


def refused(store, capsys, args, field, *texts):
    """Run ``vidax generate ARGS`` against ``store``; assert the one-line refusal and an untouched store."""
    before = tree_digest(store)
    rc = cli.main(["generate", *args, "--store", str(store)])
    out, err = capsys.readouterr()
    err = err.strip()
    assert rc == 2, (out, err)
    assert err.count("\n") == 0, f"expected one line, got: {err}"
    assert "Traceback" not in err, err
    assert err.startswith(f"vidax: error: {field}:"), err
    for t in texts:
        assert t in err, err
    assert tree_digest(store) == before, "the store changed"
    return err


LTX2 = ["--model", "ltx2-t2v", "--preset", "tiny", "--prompt", "a red kite", "--steps", "1"]


# ------------------------------------------------------------------ 1. LTX-2 stg_blocks
@pytest.mark.parametrize("value", ["999", "-1", "abc", "0,x", "", "1,,0", "2"])
def test_ltx2_stg_blocks_refused_at_validation(store, capsys, value):
    # the tiny DiT has 2 blocks: indices 0 and 1
    refused(store, capsys, [*LTX2, f"--stg-blocks={value}"], "stg_blocks", "between 0 and 1")


@pytest.mark.parametrize("value", ["0", "1", "0,1", " 1 , 0 "])
def test_ltx2_stg_blocks_within_depth_accepted(value):
    r = validate(Request(model="ltx2-t2v", prompt="a kite", steps=1, options={"stg_blocks": value}))
    assert r.options["stg_blocks"] == value


def test_ltx2_stg_blocks_default_still_valid():
    r = validate(Request(model="ltx2-t2v", prompt="a kite", steps=1))
    assert r.options["stg_blocks"] == "28"  # the reference's default: no block of the tiny DiT, as before


@pytest.mark.parametrize("value", ['"x"', '"999"', '"-1"'])
def test_ltx2_stg_blocks_refused_in_prompt_files(tmp_path, value):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine", "model": "ltx2-t2v"}\n'
                 '{"prompt": "a kite", "model": "ltx2-t2v", "stg_blocks": ' + value + '}\n')
    ok, bad = parse_prompt_file(str(f), {"steps": 1})
    assert ok.request is not None and bad.request is None
    assert bad.error.startswith(f"{f} line 2: stg_blocks:"), bad.error
    assert "between 0 and 1" in bad.error


# ------------------------------------------------------------------ 2. meshes checked at validation
@pytest.mark.parametrize("model", ["cosmos3-nano", "cosmos3-edge"])
def test_cosmos3_mesh_refused_at_validation(store, capsys, model):
    # the tiny MoT has one key/value head: tp=2 cannot split it
    refused(store, capsys, ["--model", model, "--prompt", "a red kite", "--steps", "1", "--mesh", "tp=2"],
            "mesh", "num_key_value_heads", "valid tp")


def test_cosmos3_mesh_refused_in_python_api():
    with pytest.raises(RequestError) as e:
        validate(Request(model="cosmos3-nano", prompt="a kite", steps=1, mesh="tp=2"))
    assert e.value.field == "mesh"
    validate(Request(model="cosmos3-nano", prompt="a kite", steps=1, mesh="sp=2"))  # a valid mesh still passes


# ------------------------------------------------------------------ 3. HunyuanVideo 1.5 tiny prompts
TWENTY_WORDS = ("a lighthouse at dusk on a rocky shore while waves crash below and gulls circle "
                "the lamp as light fades")


def test_hunyuanvideo15_tiny_takes_ordinary_prompts():
    assert len(TWENTY_WORDS.split()) == 20
    for model in ("hunyuanvideo1.5-480p-t2v", "hunyuanvideo1.5-720p-t2v-distilled"):
        validate(Request(model=model, prompt=TWENTY_WORDS, steps=1))
        validate(Request(model=model, prompt="a lighthouse at dusk", steps=1))


def test_every_tiny_preset_takes_an_ordinary_prompt(cond_image):
    """Every family's tiny preset takes a 20-word prompt (the byte-token presets of CogVideoX and
    LTX-2 read 226 / 256 tokens, as HunyuanVideo 1.5's reads 256)."""
    import warnings

    models = [m for m, r in registry.MODELS.items() if "tiny" in r.presets and r.family != "toy"]
    assert {registry.get(m).family for m in models} >= {"wan", "cogvideox", "cosmos", "cosmos3", "hunyuanvideo",
                                                         "hunyuanvideo15", "ltx"}
    for model in models:
        image = cond_image if registry.get(model).image == "required" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (Cosmos3-Edge's advice on unstructured prompts)
            validate(Request(model=model, prompt=TWENTY_WORDS, steps=1, image=image))


def test_hunyuanvideo15_too_long_prompt_names_the_limit(store, capsys):
    refused(store, capsys, ["--model", "hunyuanvideo1.5-480p-t2v", "--prompt", TWENTY_WORDS * 3, "--steps", "1"],
            "prompt", "tokens long", "at most 256")


# ------------------------------------------------------------------ 4. tiny first frames
@pytest.fixture(scope="module")
def tiny_images(tmp_path_factory):
    import PIL.Image

    d = tmp_path_factory.mktemp("tiny-images")
    for h, w in ((1, 1), (8, 64), (64, 15)):
        PIL.Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(d / f"{w}x{h}.png")
    return d


@pytest.mark.parametrize("name", ["1x1.png", "64x8.png", "15x64.png"])
def test_tiny_first_frame_refused(store, capsys, tiny_images, name):
    path = str(tiny_images / name)
    err = refused(store, capsys, ["--model", "wan2.1-i2v-480p", "--prompt", "x", "--frames", "5", "--steps", "1",
                                  "--image", path], "image", path, name[:-4] + " pixels", "at least 16")
    assert "Traceback" not in err


# ------------------------------------------------------------------ 5. a clip that is not a video
@pytest.mark.parametrize("model", ["cosmos2.5-2b", "cosmos3-nano"])
def test_fake_video_is_one_line(store, capsys, tmp_path, model):
    fake = tmp_path / "fake.mp4"
    fake.write_bytes(b"this is not a video\n" * 50)
    refused(store, capsys, ["--model", model, "--prompt", "a red kite", "--frames", "9", "--steps", "1",
                            "--video", str(fake)], "video", str(fake), "not a readable video")


@pytest.mark.parametrize("model", ["cosmos2.5-2b", "cosmos3-nano"])
def test_missing_video_is_one_line(store, capsys, tmp_path, model):
    missing = tmp_path / "missing.mp4"
    refused(store, capsys, ["--model", model, "--prompt", "a red kite", "--frames", "9", "--steps", "1",
                            "--video", str(missing)], "video", str(missing), "no such file")
