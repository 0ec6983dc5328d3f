"""Phase-major batches (issue 28): a prompt file's runs go encode -> sample -> decode -> mux phase by
phase, each phase loading each component once for every run of one model; every run stays its own
run, bitwise equal to the same line run alone."""
import collections
import json
from pathlib import Path

import numpy as np
import pytest

from stages import cli
from stages import run as R
from stages.prompts import parse_prompt_file
from stages.request import Request, validate
from stages.store import RunStore, read_array

MODEL = "wan2.1-t2v-1.3b"


def _opens(monkeypatch):
    """Count the weight files opened, per component folder (every tensor read opens its file)."""
    from vidax.weights import io

    counts = collections.Counter()
    real = io._safe_open

    def counting(path):
        counts[Path(path).parent.name] += 1
        return real(path)

    monkeypatch.setattr(io, "_safe_open", counting)
    return counts


def _forget_header_checks():
    import vidax.pipeline as P

    P._WEIGHTS_CHECKED.clear()  # (each batch below validates its checkpoint as a fresh process would)


def _req(folder, prompt, seed):
    return validate(Request(model=MODEL, checkpoint=str(folder), prompt=prompt, seed=seed, height=32, width=32,
                            num_frames=5, steps=2))


def _outputs(run, req):
    names = [n for n in R.stage_names(req) if n.startswith("decode/")]
    lat = read_array(run.group("sample.zarr"), "latents")
    frames = np.concatenate([read_array(run.group(f"{n}.zarr"), "frames") for n in names], 1)
    return lat, frames


PROMPTS = ["a red kite", "a blue kite", "a green kite", "a grey kite"]


def test_batch_loads_each_component_once_per_phase_and_matches_solo_runs(tiny_wan_folder, tmp_path, monkeypatch):
    reqs = [_req(tiny_wan_folder, p, i) for i, p in enumerate(PROMPTS)]
    # the same lines run alone (vidax generate), one store each
    solo = []
    for i, req in enumerate(reqs):
        run = RunStore(f"file://{tmp_path / f'solo{i}'}").run("r")
        R.generate(run, req, log=lambda m: None)
        solo.append(_outputs(run, req))
    # a 1-line batch, then a 4-line batch, counting weight-file opens
    _forget_header_checks()
    one = _opens(monkeypatch)
    items1 = R.generate_many([R.BatchItem(RunStore(f"file://{tmp_path / 'one'}").run("r"), reqs[0])],
                             log=lambda m: None)
    assert items1[0].ok
    counts1 = dict(one)
    one.clear()
    _forget_header_checks()
    store = RunStore(f"file://{tmp_path / 'four'}")
    logs = []
    items = R.generate_many([R.BatchItem(store.run(f"r{i}"), r, label=f"line {i + 1}") for i, r in enumerate(reqs)],
                            log=logs.append)
    counts4 = dict(one)
    assert all(it.ok for it in items), [it.error for it in items]
    assert set(counts1) >= {"transformer", "vae", "text_encoder"}, counts1
    for comp, n in counts1.items():
        assert counts4.get(comp, 0) <= n, (comp, counts4, counts1)
    # every run bitwise equal to its line run alone; each its own run with its own records
    for it, (lat, frames) in zip(items, solo):
        lat_b, frames_b = _outputs(it.run, it.req)
        np.testing.assert_array_equal(lat_b, lat)
        np.testing.assert_array_equal(frames_b, frames)
        assert it.run.read_json("request.json") == it.req.to_json()
        assert all(r.status == "ran" for r in it.results.values())
        assert json.loads((tmp_path / "four/runs" / it.run.run_id / "manifest.json").read_text())["run_id"] == it.run.run_id
    # phase-major order: every encode before any sampling, every sampling before any decode
    ran = [m for m in logs if m.endswith("] running")]
    kinds = [m.split("[", 1)[1].split("]")[0].split("/")[0] for m in ran]
    assert kinds == sorted(kinds, key=R.PHASES.index), kinds
    assert any(m.startswith("[sample 4/4] line 4: sample") for m in logs), logs  # progress: phase, count, line
    # a rerun of the batch resumes it: everything committed is skipped
    again = R.generate_many([R.BatchItem(store.run(f"r{i}"), r) for i, r in enumerate(reqs)], log=lambda m: None)
    assert all(r.status == "skipped" for it in again for r in it.results.values())


def test_a_failing_line_fails_alone_and_a_rerun_resumes(tmp_path, monkeypatch, capsys):
    f = tmp_path / "p.jsonl"
    base = {"steps": 1, "frames": 5, "height": 32, "width": 32}
    f.write_text("\n".join(json.dumps({"prompt": p, **base}) for p in ["a red boat", "a green boat", "a blue boat"]))
    real = R.run_sample

    def flaky(run, req, *a, **k):
        if "green" in req.prompts[0]:
            raise R.StageError("sample: injected failure for the green boat")
        return real(run, req, *a, **k)

    monkeypatch.setattr(R, "run_sample", flaky)
    url = f"file://{tmp_path / 'store'}"
    assert cli.main(["batch", str(f), "--store", url]) == 1
    out, err = capsys.readouterr()
    assert "line 2 failed" in err and "2 done, 1 failed, 0 rejected" in out, out + err
    assert "[decode" in out and "line 3: decode/0" in out  # per-phase progress names the line and stage
    runs = {p.parent.name for p in (tmp_path / "store/runs").glob("*/video.mp4")}
    assert len(runs) == 2 and not any(r.startswith("a-green-boat") for r in runs)
    green = next(p.name for p in (tmp_path / "store/runs").iterdir() if p.name.startswith("a-green-boat"))
    assert RunStore(url).run(green).record("encode") is not None  # its encode stage stays committed
    monkeypatch.setattr(R, "run_sample", real)
    assert cli.main(["batch", str(f), "--store", url]) == 0
    out, _ = capsys.readouterr()
    assert "3 done, 0 failed" in out
    assert "line 1 [sample] up to date, skipped" in out and "line 2 [encode] up to date, skipped" in out
    assert (tmp_path / "store/runs" / green / "video.mp4").exists()


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_prompt_files_take_the_cli_names(tmp_path, kind):
    f = tmp_path / f"p.{kind}"
    if kind == "jsonl":
        f.write_text(json.dumps({"prompt": "a fox", "frames": 9, "negative-prompt": "blur", "decode_stages": 2,
                                 "run_id": "fox-1"}) + "\n"
                     + json.dumps({"prompt": "a cat", "frames": 9, "num_frames": 9}) + "\n")
    else:
        f.write_text("prompt,frames,negative_prompt,decode-stages,run_id\na fox,9,blur,2,fox-1\n")
    lines = parse_prompt_file(str(f), {"height": 32, "width": 32, "steps": 1})
    a = lines[0]
    assert a.error is None, a.error
    assert a.request.num_frames == 9 and a.request.negative_prompt == "blur" and a.request.decode_stages == 2
    assert a.run_id == "fox-1"
    if kind == "jsonl":
        assert lines[1].request is None and "num_frames: given twice" in lines[1].error


def test_phase_weights_shares_loads_within_the_block_only():
    from vidax.pipeline import Pipeline, phase_weights
    from vidax.weights.io import HeadersChecked, headers_only

    calls = []

    class Toy(Pipeline):
        def __init__(self, source, dtype="float32"):
            self.source, self.dtype = source, dtype

        def load_dit(self, expert=1):
            calls.append((self.source, self.dtype, expert))
            if expert == 3:
                raise HeadersChecked()
            return object()

    a, b, c = Toy("ckpt"), Toy("ckpt"), Toy("ckpt", dtype="bfloat16")
    assert a.load_dit() is not a.load_dit() and len(calls) == 2  # outside a phase: every call loads
    calls.clear()
    with phase_weights():
        x = a.load_dit()
        assert b.load_dit() is x and a.load_dit(expert=1) is not None  # same settings: one load
        assert c.load_dit() is not x  # another dtype: its own load
        assert calls == [("ckpt", "float32", 1), ("ckpt", "bfloat16", 1)]
        a.load_dit(2)  # the other expert replaces the one held ...
        assert a.load_dit() is not x and len(calls) == 4  # ... so the first is loaded again
        with headers_only(), pytest.raises(HeadersChecked):
            a.load_dit(3)  # header checks never use the cache
    calls.clear()
    a.load_dit()
    assert calls == [("ckpt", "float32", 1)]  # the block's end dropped everything


def test_mixed_models_are_grouped_by_model_and_match_solo_runs(tmp_path):
    reqs = [validate(Request(model=m, prompt=f"a kite {i}", seed=i, steps=1))
            for i, m in enumerate([MODEL, "ltx-video-0.9", MODEL])]
    solo = []
    for i, req in enumerate(reqs):
        run = RunStore(f"file://{tmp_path / f'solo{i}'}").run("r")
        R.generate(run, req, log=lambda m: None)
        solo.append(_outputs(run, req))
    logs = []
    store = RunStore(f"file://{tmp_path / 'b'}")
    items = R.generate_many([R.BatchItem(store.run(f"r{i}"), r, label=f"line {i + 1}") for i, r in enumerate(reqs)],
                            log=logs.append)
    assert all(it.ok for it in items), [it.error for it in items]
    order = [m.split(":")[0].split("] ")[1] for m in logs if m.startswith("[sample ")]
    assert order == ["line 1", "line 3", "line 2"]  # the two Wan lines share their phase's weights
    for it, (lat, frames) in zip(items, solo):
        lat_b, frames_b = _outputs(it.run, it.req)
        np.testing.assert_array_equal(lat_b, lat)
        np.testing.assert_array_equal(frames_b, frames)
