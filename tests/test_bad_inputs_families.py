"""Every family's declared options are validated like the common fields, in the CLI and in prompt
files, before anything is written (validation only: no weight is loaded).

- the CLI: per family, a value out of range / not of the option's type / not one of its choices
  for each option -> exit 2, one line ``vidax: error: <option>: ...`` naming it, no traceback, the
  store (holding a finished run) byte-identical;
- prompt files: for every option of every registered model, a line giving it a value of the wrong
  JSON type is rejected naming the option (and its line), the other lines kept."""
import json

import pytest

from stages.prompts import parse_prompt_file
from tests.test_bad_inputs_options import refused
from vidax import registry

BASE = ["--prompt", "a red kite over the sea", "--steps", "1"]

CLI_CASES = [
    # (model, flag, bad value, field, text in the message)
    ("wan2.1-t2v-1.3b", "--vae-tiling", "maybe", "vae_tiling", "not a bool"),
    ("cogvideox-2b", "--dynamic-cfg", "2", "dynamic_cfg", "not a bool"),
    ("cogvideox-2b", "--scheduler", "unipc", "scheduler", "choose one of ddim, dpm"),
    ("cogvideox-2b", "--vae-tiling", "yes please", "vae_tiling", "not a bool"),
    ("cosmos2.5-2b", "--cond-frames", "3", "cond_frames", "choose one of 1, 2"),
    ("cosmos2.5-2b", "--cond-timestep", "1.5", "cond_timestep", "<= 1.0"),
    ("cosmos2.5-2b", "--cond-timestep", "nan", "cond_timestep", "finite"),
    ("cosmos2.5-2b", "--vae-tiling", "on", "vae_tiling", "not a bool"),
    ("cosmos3-nano", "--cond-frames", "0", "cond_frames", ">= 1"),
    ("cosmos3-nano", "--cond-frames", "17", "cond_frames", "<= 16"),
    ("cosmos3-nano", "--cond-frames", "two", "cond_frames", "not an int"),
    ("cosmos3-nano", "--metadata", "sometimes", "metadata", "not a bool"),
    ("cosmos3-nano", "--shift", "-1", "shift", ">= 0.0"),
    ("cosmos3-nano", "--system-prompt", "x", "system_prompt", "not a bool"),
    ("cosmos3-nano", "--video-keep", "middle", "video_keep", "choose one of first, last"),
    ("cosmos3-nano", "--vae-tiling", "2", "vae_tiling", "not a bool"),
    ("hunyuanvideo-t2v", "--shift", "inf", "shift", "finite"),
    ("hunyuanvideo-t2v", "--true-cfg", "0.5", "true_cfg", ">= 1.0"),
    ("hunyuanvideo-t2v", "--vae-tiling", "t", "vae_tiling", "not a bool"),
    ("hunyuanvideo1.5-480p-t2v", "--shift", "101", "shift", "<= 100.0"),
    ("hunyuanvideo1.5-480p-t2v", "--vae-chunk", "-1", "vae_chunk", ">= 0"),
    ("hunyuanvideo1.5-480p-t2v", "--vae-chunk", "2000", "vae_chunk", "<= 1024"),
    ("hunyuanvideo1.5-480p-t2v", "--vae-chunk", "1.5", "vae_chunk", "not an int"),
    ("hunyuanvideo1.5-480p-t2v", "--vae-tiling", "nope", "vae_tiling", "not a bool"),
    ("ltx-video-0.9", "--decode-noise-scale", "2", "decode_noise_scale", "<= 1.0"),
    ("ltx-video-0.9", "--decode-timestep", "-0.1", "decode_timestep", ">= 0.0"),
    ("ltx-video-0.9", "--guidance-rescale", "1.5", "guidance_rescale", "<= 1.0"),
    ("ltx-video-0.9", "--vae-tiling", "2", "vae_tiling", "not a bool"),
    ("ltx2-t2v", "--audio", "loud", "audio", "not a bool"),
    ("ltx2-t2v", "--audio-guidance", "-1", "audio_guidance", ">= 0.0"),
    ("ltx2-t2v", "--audio-guidance-rescale", "2", "audio_guidance_rescale", "<= 1.0"),
    ("ltx2-t2v", "--audio-modality-scale", "nan", "audio_modality_scale", "finite"),
    ("ltx2-t2v", "--audio-stg-scale", "101", "audio_stg_scale", "<= 100.0"),
    ("ltx2-t2v", "--decoder-steps", "0", "decoder_steps", ">= 1"),
    ("ltx2-t2v", "--decoder-steps", "51", "decoder_steps", "<= 50"),
    ("ltx2-t2v", "--modality-scale", "-3", "modality_scale", ">= 0.0"),
    ("ltx2-t2v", "--stg-scale", "inf", "stg_scale", "finite"),
    ("ltx2-t2v", "--use-cross-timestep", "x", "use_cross_timestep", "not a bool"),
    ("ltx2-t2v", "--vae-decoder", "pixel", "vae_decoder", "choose one of vae, diffusion"),
]


@pytest.mark.parametrize("model,flag,value,field,text", CLI_CASES,
                         ids=[f"{c[0]}{c[1]}={c[2]}" for c in CLI_CASES])
def test_family_option_refused_at_validation(store, capsys, model, flag, value, field, text):
    refused(store, capsys, ["--model", model, *BASE, f"{flag}={value}"], field, text)


@pytest.mark.parametrize("value,text", [("52", "<= 51"), ("-1", ">= 0"), ("high", "not an int")])
def test_ltx2_i2v_image_crf(store, capsys, cond_image, value, text):
    refused(store, capsys, ["--model", "ltx2-i2v", *BASE, "--image", cond_image, f"--image-crf={value}"],
            "image_crf", text)


def test_every_declared_option_has_a_case():
    """The catalogue above, the stg_blocks cases (tests/test_bad_inputs_options.py) and the Wan
    cases (tests/test_bad_inputs.py) together name every option of every family."""
    covered = {(registry.get(m).family, f) for m, _, _, f, _ in CLI_CASES}
    covered |= {("ltx", "stg_blocks"), ("ltx", "image_crf"), ("wan", "shift"), ("wan", "scheduler"),
                ("wan", "guidance_2"), ("cosmos", "video"), ("cosmos3", "video")}
    declared = {(r.family, o.name) for r in registry.MODELS.values() for o in r.options
                if r.family != "toy"}
    assert declared - covered == set()


# ------------------------------------------------------------------ prompt files, every option of every model
def _wrong_type(option):
    return {bool: "yes", int: "3", float: "1.5", str: 3}[option.type]


OPTION_LINES = sorted({(m, o.name) for m, r in registry.MODELS.items() for o in r.options})


@pytest.mark.parametrize("model,name", OPTION_LINES, ids=[f"{m}:{n}" for m, n in OPTION_LINES])
def test_prompt_file_option_of_the_wrong_type(tmp_path, model, name):
    option = registry.get(model).option(name)
    f = tmp_path / "p.jsonl"
    line = {"prompt": "a kite", "model": model, name: _wrong_type(option)}
    if registry.get(model).image == "required":
        line["image"] = "first-frame.png"  # (refused for the option first: the image is never read)
    f.write_text("\n" + json.dumps(line) + "\n")
    (bad,) = parse_prompt_file(str(f), {"steps": 1})
    assert bad.request is None and bad.error.startswith(f"{f} line 2: {name}:"), bad.error
    assert f"not a{'n' if option.type.__name__[0] in 'aeiou' else ''} {option.type.__name__}" in bad.error
    assert "\n" not in bad.error


# ------------------------------------------------------------------ cross-field rules
@pytest.fixture(scope="module")
def short_clip(tmp_path_factory):
    import numpy as np

    from vidax.video import write_mp4

    p = tmp_path_factory.mktemp("clips") / "short.mp4"
    write_mp4((np.random.default_rng(1).random((3, 48, 64, 3)) * 255).astype(np.uint8), p, fps=8)
    return str(p)


def test_cosmos25_cond_frames_against_the_clip(store, capsys, short_clip):
    refused(store, capsys, ["--model", "cosmos2.5-2b", *BASE, "--frames", "9", "--video", short_clip,
                            "--cond-frames", "2"], "video", "has 3 frames", "needs at least 5")


def test_cosmos3_cond_frames_against_the_frame_count(store, capsys, short_clip):
    refused(store, capsys, ["--model", "cosmos3-nano", *BASE, "--frames", "5", "--video", short_clip,
                            "--cond-frames", "3"], "cond_frames", "do not fit 5 frames")


def test_vidax_batch_of_bad_option_lines(store, capsys, tmp_path):
    """The prompt-file catalogue through ``vidax batch``: a file whose every line gives one option of
    one model a value of the wrong type exits 2, one stderr line per rejected line naming its line
    number and the option, no traceback, and the store (holding a finished run) byte-identical."""
    from stages import cli
    from tests.test_bad_inputs import tree_digest

    f = tmp_path / "bad-options.jsonl"
    lines = []
    for model, name in OPTION_LINES:
        line = {"prompt": "a kite", "model": model, "steps": 1, name: _wrong_type(registry.get(model).option(name))}
        if registry.get(model).image == "required":
            line["image"] = "first-frame.png"
        lines.append(json.dumps(line))
    f.write_text("\n".join(lines) + "\n")
    before = tree_digest(store)
    rc = cli.main(["batch", str(f), "--store", str(store)])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert "Traceback" not in out + err
    rejected = err.strip().splitlines()
    assert len(rejected) == len(OPTION_LINES), err
    for i, ((model, name), msg) in enumerate(zip(OPTION_LINES, rejected)):
        assert msg.startswith(f"vidax: rejected: {f} line {i + 1}: {name}:"), msg
    assert f"0 prompt(s) to run, {len(OPTION_LINES)} line(s) rejected" in out
    assert tree_digest(store) == before, "the store changed"
