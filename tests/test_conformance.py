"""Registry conformance: every registered recipe (and the test-only audio+video family) runs
through the stages from its tiny preset, resumes after a SIGKILL during sampling with bitwise-equal
latents, reruns one decode stage alone with identical outputs, and refuses an option it does not
declare. A new family gets these checks by registering.

``make test`` kills, resumes and reruns one case per family (a seeded sample, ``tests/sweep.py``)
and runs every other case's stages once; ``make test-all`` kills every case."""
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from stages import cli
from stages import run as R
from stages.request import Request, RequestError, validate
from stages.store import RunStore, read_array
from tests import sweep
from vidax import registry
from tests.children import ENV

IMAGE_CASES = {"none": [False], "required": [True], "optional": [False, True]}
ALL_CASES = [(m, img) for m in sorted(registry.MODELS) for img in IMAGE_CASES[registry.MODELS[m].image]]


def _code_path(model: str, with_image: bool) -> tuple:
    """What a case exercises: recipes that share the pipeline class, the tiny preset they resolve to,
    their option set and the defaults of their switches (bool options, e.g. a tiled decode) run the
    very same code through the stages (they differ only in real-size defaults and numeric
    parameters), so one case covers them."""
    r = registry.MODELS[model]
    switches = tuple(sorted((o.name, r.settings("tiny").get(o.name)) for o in r.options if o.type is bool))
    return r.pipeline, r.source("tiny", None, with_image), tuple(sorted(r.option_names or ())), switches, with_image


CASES = list({_code_path(m, i): (m, i) for m, i in reversed(ALL_CASES)}.values())[::-1]
#: the cases killed during sampling, resumed and rerun: all under make test-all, one per family otherwise
KILLED = sweep.sample_per_group(CASES, lambda c: registry.MODELS[c[0]].family, 1, "conformance")


def _outputs(run, group, names=None):
    g = run.group(group)
    return {n: read_array(g, n) for n in (names or sorted(g.array_keys()))}


def test_cases_cover_every_recipe():
    covered = {_code_path(m, i) for m, i in CASES}
    assert all(_code_path(m, i) in covered for m, i in ALL_CASES)
    assert len(CASES) == len(covered)


def test_every_family_is_registered():
    families = {r.family for r in registry.MODELS.values()}
    assert {"wan", "toy"} <= families
    for r in registry.MODELS.values():
        assert r.presets and "tiny" in r.presets, r.model_id


@pytest.mark.parametrize("model,with_image", CASES, ids=[f"{m}{'-image' if i else ''}" for m, i in CASES])
def test_recipe_conformance(tmp_path, cond_image, model, with_image):
    recipe = registry.get(model)
    geo = recipe.build("tiny", None, with_image).geometry()
    frames = geo.frames_multiple + 1
    args = ["generate", "--model", model, "--prompt", "a fox in snow", "--frames", str(frames), "--steps", "4",
            "--checkpoint-every", "1", "--run-id", "x"]
    if with_image:
        args += ["--image", cond_image]
    killed = f"file://{tmp_path / 'killed'}"
    if (model, with_image) not in KILLED:  # its family's killed case is another one: the stages once
        assert cli.main([*args, "--store", killed]) == 0
        run = RunStore(killed).run("x")
        req = R.load_request(run)
        assert all(run.record(s)["status"] == "done" for s in R.stage_names(req))
        assert run.record("sample")["details"]["resumed_from_step"] == 0
        _refuses_undeclared_options(model)
        return
    # 1. SIGKILL during sampling: nothing committed for sample, a whole checkpoint left behind
    p = subprocess.run([sys.executable, "-m", "stages.cli", *args, "--store", killed],
                       env={**ENV, "VIDAX_FAULTS": "sample:kill_after_step=2"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    run = RunStore(killed).run("x")
    assert run.record("encode") is not None and run.record("sample") is None
    # 2. resume: picks up at step 2 and finishes every stage
    assert cli.main([*args, "--store", killed]) == 0
    assert run.record("sample")["details"]["resumed_from_step"] == 2
    req = R.load_request(run)
    names = R.stage_names(req)
    assert names[:2] == ["encode", "sample"] and names[-1] == "mux"
    assert all(run.record(s)["status"] == "done" for s in names)
    # 3. bitwise equal to a run that never stopped
    clean = RunStore(f"file://{tmp_path / 'clean'}").run("x")
    R.generate(clean, req, log=lambda m: None)
    a, b = _outputs(run, "sample.zarr"), _outputs(clean, "sample.zarr")
    assert sorted(a) == sorted(b) and a
    for n in a:
        assert a[n].tobytes() == b[n].tobytes(), f"sample output {n} differs after resume"
    # 4. one decode stage rerun alone: same outputs, no other stage touched
    decodes = [s for s in names if s.startswith("decode/")]
    target = decodes[-1]
    before = _outputs(run, f"{target}.zarr")
    finished = {s: run.record(s)["finished"] for s in names}
    run.delete(f"{target}.zarr")
    assert R.stage_status(run, target, R.stage_keys(req, R.make_pipeline(req))[target]) == "corrupt"
    import time

    time.sleep(1.1)
    assert cli.main(["rerun", "x", "--stage", target, "--store", killed]) == 0
    assert [s for s in names if run.record(s)["finished"] != finished[s]] == [target]
    after = _outputs(run, f"{target}.zarr")
    for n in before:
        np.testing.assert_array_equal(after[n], before[n])
    # 5. an option the family does not declare is refused, naming it
    _refuses_undeclared_options(model)


def _refuses_undeclared_options(model):
    with pytest.raises(RequestError, match=r"^no_such_option: .*no option 'no_such_option'"):
        validate(Request(model=model, prompt="x", options={"no_such_option": 1}))
    with pytest.raises(RequestError, match=r"^no_such_option: unknown request field"):
        Request.from_json({"model": model, "prompt": "x", "no_such_option": 1})


def test_audio_family_muxes_a_sound_track(tmp_path):
    import imageio_ffmpeg

    url = f"file://{tmp_path}"
    assert cli.main(["generate", "--model", "toy-av", "--prompt", "rain on a tin roof", "--frames", "17",
                     "--steps", "2", "--fps", "8", "--run-id", "av", "--store", url]) == 0
    run = RunStore(url).run("av")
    req = R.load_request(run)
    assert "decode/audio" in R.stage_names(req)
    wav = run.group("decode/audio.zarr")["waveform"]
    assert wav.attrs["sample_rate"] == 8000 and wav.metadata.dimension_names == ("batch", "channel", "sample")
    mp4 = tmp_path / "runs/av/video.mp4"
    info = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-i", str(mp4)], capture_output=True, text=True).stderr
    assert re.search(r"Stream #0:\d.*Audio: aac", info), info
    # decode the audio track: its duration is the video's (17 frames at 8 fps)
    pcm = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(mp4), "-vn", "-f", "s16le",
                          "-ac", "1", "-ar", "8000", "-"], capture_output=True).stdout
    seconds = len(pcm) / 2 / 8000
    assert abs(seconds - 17 / 8) < 0.1, seconds
    # a video-only request has no audio stage and no audio track
    assert cli.main(["generate", "--model", "toy-av", "--prompt", "rain on a tin roof", "--frames", "17",
                     "--steps", "2", "--audio", "false", "--run-id", "silent", "--store", url]) == 0
    silent = R.load_request(RunStore(url).run("silent"))
    assert "decode/audio" not in R.stage_names(silent)
    info = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-i", str(tmp_path / "runs/silent/video.mp4")],
                          capture_output=True, text=True).stderr
    assert "Audio:" not in info


def test_option_changes_only_the_stages_that_read_it(tmp_path):
    """A decode-only option (the toy's ``tone``) reruns decode and mux, never encode or sample."""
    url = f"file://{tmp_path}"
    base = ["generate", "--model", "toy-av", "--prompt", "wind", "--frames", "9", "--steps", "2", "--store", url]
    assert cli.main(base + ["--run-id", "t"]) == 0
    run = RunStore(url).run("t")
    req = R.load_request(run)
    k1 = R.stage_keys(req, R.make_pipeline(req))
    req2 = validate(Request.from_json({**req.to_json(), "tone": 220.0}))
    k2 = R.stage_keys(req2, R.make_pipeline(req2))
    assert k1["encode"] == k2["encode"] and k1["sample"] == k2["sample"]
    assert k1["decode/audio"] != k2["decode/audio"] and k1["mux"] != k2["mux"]
    assert k1["decode/0"] == k2["decode/0"]
