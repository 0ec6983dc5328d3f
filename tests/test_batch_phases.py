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


# a value for every request flag of ``vidax generate`` (as command-line text); a flag added to the CLI
# without one here fails the test below, which then checks that a prompt file can set it
FLAG_TEXT = {"model": "wan2.1-t2v-1.3b", "preset": "tiny", "checkpoint": "gs://b/ckpt", "prompt": "a fox",
             "negative_prompt": "blur", "seed": "7", "height": "48", "width": "64", "frames": "9", "steps": "3",
             "guidance": "4.5", "image": "gs://b/first.png", "fps": "12", "decode_stages": "2",
             "checkpoint_every": "1", "dtype": "bfloat16", "mesh": "dp=1,tp=2", "offload_chunk_size": "all",
             "lora": "gs://b/style.safetensors:0.5", "run_id": "fox-1", "cache": "magcache",
             "cache_threshold": "0.1", "cache_max_skips": "2", "cache_retention": "0.3", "cache_ratios": "1.0,0.9",
             "cache_interval": "4", "cache_warmup": "2", "cache_order": "2"}
NOT_REQUEST = {"help", "store"}


def _option_text(o) -> str:
    if o.choices:
        return str(o.choices[-1])
    if o.type is bool:
        return "false" if o.default else "true"
    return str(o.minimum if o.minimum is not None else 3)


def test_every_generate_flag_has_its_prompt_file_key(tmp_path, monkeypatch):
    """Item 5 of issue 28: for every model, each request flag of ``vidax generate`` given as a CSV
    column (its text as on the command line) or a JSONL key (named as the flag, typed) makes the same
    request as the flag; the README's prompt-file section names each common key."""
    import dataclasses
    import re
    import stages.prompts as P
    from vidax import registry

    monkeypatch.setattr(P, "validate", lambda r: r)  # the raw requests (values need not make a runnable one)
    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    section = readme[readme.index("Prompt files (`vidax batch FILE`"):readme.index("A batch runs phase by phase")]
    fields = {f.name for f in dataclasses.fields(Request)} - {"options"}
    seen = set()
    for model, recipe in registry.MODELS.items():
        if tuple(recipe.options) in seen:  # one model of each set of options (the rest of the flags are common)
            continue
        seen.add(tuple(recipe.options))
        parser = cli.build_parser(model)
        gen = parser._subparsers._group_actions[0].choices["generate"]
        flags = {max(a.option_strings, key=len).lstrip("-"): a for a in gen._actions
                 if a.option_strings and a.dest not in NOT_REQUEST}
        options = {o.flag.lstrip("-"): o for o in recipe.options}
        assert set(options) <= set(flags), model
        text = {}
        for flag, a in flags.items():
            key = P.canonical(flag)
            if flag in options:
                assert key == options[flag].name, (model, flag)
                text[flag] = _option_text(options[flag])
            else:
                assert key in fields | {"run_id"}, f"{model}: --{flag} sets no request field its prompt-file key names"
                assert f"`{flag.replace('-', '_')}`" in section, f"README's prompt-file keys lack `{flag}`"
                assert flag.replace("-", "_") in FLAG_TEXT, f"--{flag}: give it a value in FLAG_TEXT"
                text[flag] = FLAG_TEXT[flag.replace("-", "_")] if flag != "model" else model
        argv = ["generate"] + [x for flag, v in text.items() for x in (f"--{flag}", v)]
        ns = parser.parse_args(argv)
        want = cli._request_from_args(ns).to_json()
        want["lora"] = list(want["lora"])
        # CSV: the flags' own names and text
        f = tmp_path / "p.csv"
        with f.open("w", newline="") as fh:
            import csv

            w = csv.writer(fh)
            w.writerow(list(text))
            w.writerow(list(text.values()))
        (line,) = P.parse_prompt_file(str(f))
        assert line.error is None, (model, line.error)
        got = line.request.to_json()
        got["lora"] = [got["lora"]] if isinstance(got["lora"], str) else got["lora"]
        assert got == want, (model, {k: (got.get(k), want.get(k)) for k in want if got.get(k) != want.get(k)})
        assert line.run_id == ns.run_id
        # JSONL: typed values, the keys named as the request's fields (underscores)
        typed = {P.canonical(k): getattr(ns, a.dest) if k not in options else options[k].parse(text[k])
                 for k, a in flags.items()}
        typed["cache_ratios"] = [1.0, 0.9]
        f = tmp_path / "p.jsonl"
        f.write_text(json.dumps(typed) + "\n")
        (line,) = P.parse_prompt_file(str(f))
        assert line.error is None, (model, line.error)
        assert line.request.to_json() == want and line.run_id == ns.run_id, model
    assert re.search(r"\| `frames` \(or `num_frames`\) \| `--frames` \|", section)
