"""Bad input gets a clear error and loses nothing.

Every case below is a request a user could make by mistake. For each: the exit code (CLI) or the
exception type (Python API, prompt files), a message naming the culprit, and a store that is
byte-identical before and after (it already holds a finished run, which must stay untouched)."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stages import cli
from stages.prompts import PromptFileError, parse_prompt_file
from stages.request import Request, RequestError, validate
from stages.store import RunStore, StoreError


# ------------------------------------------------------------------ fixtures
def tree_digest(root: Path) -> dict:
    if not root.exists():
        return {}
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    import PIL.Image

    d = tmp_path_factory.mktemp("images")
    good = d / "good.png"
    PIL.Image.fromarray((np.random.default_rng(0).random((40, 60, 3)) * 255).astype(np.uint8)).save(good)
    data = good.read_bytes()
    (d / "truncated.png").write_bytes(data[: len(data) // 2])
    (d / "text.png").write_text("not an image")
    (d / "empty.png").write_bytes(b"")
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    (d / "empty").mkdir()
    (d / "config-only").mkdir()
    (d / "config-only" / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 24}))
    (d / "bad-json").mkdir()
    (d / "bad-json" / "model_index.json").write_text("{not json")
    (d / "a-file").write_text("x")
    return d


# ------------------------------------------------------------------ the CLI
BASE = ["--prompt", "a red kite", "--frames", "5", "--steps", "1", "--height", "32", "--width", "32"]

CLI_CASES = [
    # (args replacing/adding to BASE, field named in the message, text in the message)
    (["--model", "wan9"], "model", "available"),
    (["--height", "40"], "height", "multiple of 16"),
    (["--width", "0"], "width", "multiple of 16"),
    (["--frames", "8"], "num_frames", "4k+1"),
    (["--frames", "40001"], "num_frames", "positional"),
    (["--height", "100000", "--width", "100000"], "height", "positional"),
    (["--prompt", "   "], "prompt", "non-empty"),
    (["--prompt", "a\x07bell"], "prompt", "control character"),
    (["--prompt", "x" * 20001], "prompt", "at most 20000"),
    (["--prompt", "a long prompt " * 30], "prompt", "tokens long"),
    (["--negative-prompt", "tab\x0bvertical"], "negative_prompt", "control character"),
    (["--run-id", "../evil"], "run_id", "letters, digits"),
    (["--run-id", "a/b"], "run_id", "letters, digits"),
    (["--run-id", ""], "run_id", "letters, digits"),
    (["--preset", "huge"], "preset", "presets: tiny"),
    (["--decode-stages", "9"], "decode_stages", "between 1 and 2"),
    (["--checkpoint-every", "0"], "checkpoint_every", ">= 1"),
    (["--mesh", "tp=two"], "mesh", "integer"),
    (["--mesh", "tp=2,tp=2"], "mesh", "given twice"),
    (["--mesh", "tp=16"], "mesh", "needs 16 devices"),
    (["--mesh", "tp=3"], "mesh", "attention heads"),
    (["--mesh", "tp=0"], "mesh", ">= 1"),
    (["--mesh", "pp=2"], "mesh", "unknown axes"),
    (["--offload-chunk-size", "0"], "offload_chunk_size", "or all"),
    (["--offload-chunk-size", "some"], "offload_chunk_size", "or all"),
    (["--seed", "4294967296"], "seed", "between 0 and 4294967295"),
    (["--seed", "-1"], "seed", "between 0"),
    (["--guidance", "nan"], "guidance", "finite"),
    (["--guidance", "inf"], "guidance", "finite"),
    (["--guidance", "-1"], "guidance", "between 0"),
    (["--guidance", "1000"], "guidance", "between 0 and 100"),
    (["--fps", "nan"], "fps", "finite"),
    (["--fps", "0"], "fps", "(0, 240]"),
    (["--fps", "-5"], "fps", "(0, 240]"),
    (["--fps", "1000"], "fps", "(0, 240]"),
    (["--steps", "0"], "steps", "between 1 and 1000"),
    (["--steps", "100000"], "steps", "between 1 and 1000"),
    (["--shift", "nan"], "shift", "finite"),
    (["--shift", "-1"], "shift", ">= 0.0"),
    (["--shift", "abc"], "shift", "not a float"),
    (["--scheduler", "ddim"], "scheduler", "choose one of"),
    (["--model", "wan2.2-t2v-a14b", "--guidance-2", "nan"], "guidance_2", "finite"),
    (["--model", "wan2.2-t2v-a14b", "--guidance-2", "-2"], "guidance_2", ">= 0.0"),
]


def _run_cli(args, store_dir, capsys):
    rc = cli.main(["generate", *args, "--store", str(store_dir)])
    out, err = capsys.readouterr()
    return rc, out, err.strip()


@pytest.mark.parametrize("args,field,text", CLI_CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CLI_CASES)])
def test_cli_refuses_before_writing(store, capsys, args, field, text):
    before = tree_digest(store)
    base = list(BASE)
    for i in range(0, len(args)):
        if args[i].startswith("--") and args[i] in base:
            j = base.index(args[i])
            del base[j:j + 2]
    rc, out, err = _run_cli(base + args, store, capsys)
    assert rc == 2, (out, err)
    assert err.count("\n") == 0, f"expected one line, got: {err}"
    assert err.startswith(f"vidax: error: {field}:"), err
    assert text in err, err
    assert tree_digest(store) == before, "the store changed"


@pytest.mark.parametrize("args,flag", [
    (["--dtype", "float16"], "--dtype"),
    (["--guidance-2", "3"], "--guidance-2"),  # wan2.1 has one expert: the option is not declared
    (["--bogus", "1"], "--bogus"),
    (["--steps", "2.5"], "--steps"),
    (["--seed", "1e3"], "--seed"),
])
def test_cli_refuses_unknown_flags_and_types(store, capsys, args, flag):
    before = tree_digest(store)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", *BASE, *args, "--store", str(store)])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err
    assert tree_digest(store) == before


IMAGE_CASES = [
    ("wan2.1-t2v-1.3b", "good.png", "takes no image"),
    ("wan2.1-i2v-480p", None, "image-to-video model"),
    ("wan2.1-i2v-480p", "missing.png", "cannot read"),
    ("wan2.1-i2v-480p", "text.png", "cannot read"),
    ("wan2.1-i2v-480p", "empty.png", "cannot read"),
    ("wan2.1-i2v-480p", "truncated.png", "cannot read"),
]


@pytest.mark.parametrize("model,image,text", IMAGE_CASES)
def test_cli_refuses_bad_images(store, images, capsys, model, image, text):
    before = tree_digest(store)
    args = ["--prompt", "x", "--frames", "5", "--steps", "1", "--model", model]
    if image:
        args += ["--image", str(images / image)]
    rc, out, err = _run_cli(args, store, capsys)
    assert rc == 2 and err.startswith("vidax: error: image:") and text in err, err
    if image and image != "good.png":
        assert image in err  # the message names the file
    assert tree_digest(store) == before


@pytest.mark.parametrize("folder,text", [("empty", "empty"), ("config-only", "config-only"), ("bad-json", "bad-json"),
                                         ("missing", "no such folder"), ("a-file", "not a folder")])
def test_cli_refuses_bad_checkpoint_folders(store, folders, capsys, folder, text):
    before = tree_digest(store)
    rc, out, err = _run_cli([*BASE, "--checkpoint", str(folders / folder)], store, capsys)
    assert rc == 2 and err.startswith("vidax: error: checkpoint:") and text in err, err
    assert tree_digest(store) == before


@pytest.mark.parametrize("url,text", [("", "empty"), ("gs://", "no bucket"), ("gs:///prefix", "no bucket")])
def test_cli_refuses_bad_store_urls(tmp_path, capsys, monkeypatch, url, text):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["generate", *BASE, "--store", url])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("vidax: error: store:") and text in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written in the working directory


@pytest.mark.parametrize("name,value,text", [("VIDAX_CPU_CONV", "oneDNN", "expected 'xla'"),
                                             ("VIDAX_COMPILE_CACHE_MAX_GB", "lots", "a number"),
                                             ("VIDAX_COMPILE_CACHE_MIN_SECONDS", "-1", "at least 0")])
def test_cli_refuses_bad_settings(store, capsys, monkeypatch, name, value, text):
    """A vidax environment setting it cannot use: one line naming the variable, exit 2, nothing written."""
    from vidax.core import runtime

    monkeypatch.setattr(runtime, "_done", False)  # the process's settings are read again
    monkeypatch.setenv(name, value)
    before = tree_digest(store)
    rc, out, err = _run_cli(list(BASE), store, capsys)
    assert rc == 2 and err.count("\n") == 0 and err.startswith(f"vidax: error: {name}='{value}':") and text in err, err
    assert tree_digest(store) == before


def test_cli_refuses_a_store_under_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc = cli.main(["generate", *BASE, "--store", str(f / "sub")])
    assert rc == 2 and "cannot write to store" in capsys.readouterr().err
    assert f.read_text() == "x"


# ------------------------------------------------------------------ the Python API
API_CASES = [
    (dict(seed=True), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(steps=2.5), "steps"),
    (dict(steps=True), "steps"),
    (dict(height="32"), "height"),
    (dict(num_frames=5.0), "num_frames"),
    (dict(guidance=float("nan")), "guidance"),
    (dict(guidance="5"), "guidance"),
    (dict(fps=float("inf")), "fps"),
    (dict(prompt=123), "prompt"),
    (dict(prompt=["ok", ""]), "prompt"),
    (dict(prompt="nul\x00byte"), "prompt"),
    (dict(prompt="x" * 10_000_000), "prompt"),
    (dict(negative_prompt=5), "negative_prompt"),
    (dict(options={"shift": "3"}), "shift"),
    (dict(options={"shift": float("inf")}), "shift"),
    (dict(options={"scheduler": 3}), "scheduler"),
    (dict(options={"bogus": 1}), "bogus"),
    (dict(options="shift=3"), "options"),
    (dict(mesh=5), "mesh"),
    (dict(dtype="float16"), "dtype"),
    (dict(checkpoint_every=0), "checkpoint_every"),
    (dict(decode_stages=0), "decode_stages"),
]


@pytest.mark.parametrize("over,field", API_CASES, ids=[c[1] + f"-{i}" for i, c in enumerate(API_CASES)])
def test_python_api_refuses(over, field):
    kw = dict(prompt="a kite", height=32, width=32, num_frames=5, steps=1)
    kw.update(over)
    with pytest.raises(RequestError) as e:
        validate(Request(**kw))
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


@pytest.mark.parametrize("doc,field", [({"prompt": "x", "unknown": 1}, "unknown"), ("a string", "request"),
                                       ({"prompt": "x", "options": [1]}, "options")])
def test_request_json_refused(doc, field):
    with pytest.raises(RequestError) as e:
        Request.from_json(doc)
    assert e.value.field == field


# ------------------------------------------------------------------ prompt files
@pytest.mark.parametrize("name,content,text", [
    ("empty.txt", "", "no prompts"),
    ("blank.txt", "\n  \n\t\n", "no prompts"),
    ("comments.txt", "# one\n# two\n", "no prompts"),
    ("empty.jsonl", "\n\n", "no prompts"),
    ("header-only.csv", "prompt,seed\n", "no prompts"),
    ("no-prompt.csv", "text,seed\nx,1\n", "'prompt' column"),
    ("prompts.yaml", "- x\n", "unknown prompt file type"),
    ("noext", "x\n", "unknown prompt file type"),
])
def test_prompt_files_refused_whole(tmp_path, name, content, text):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(PromptFileError) as e:
        parse_prompt_file(str(f))
    assert str(f) in str(e.value) and text in str(e.value)


def test_prompt_file_missing_or_not_utf8(tmp_path):
    with pytest.raises(PromptFileError, match="no such file"):
        parse_prompt_file(str(tmp_path / "absent.txt"))
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(PromptFileError, match="not UTF-8"):
        parse_prompt_file(str(f))


DEFAULTS = {"height": 32, "width": 32, "num_frames": 5, "steps": 1}


@pytest.mark.parametrize("line,field", [
    ('{"prompt": "x", "steps": 2.7}', "steps"),
    ('{"prompt": "x", "steps": true}', "steps"),
    ('{"prompt": "x", "seed": "1"}', "seed"),
    ('{"prompt": 42}', "prompt"),
    ('{"prompt": "x", "guidance": null, "fps": "fast"}', "fps"),
    ('["x"]', "line"),
    ('{"prompt": "x"', "line"),
    ('{"prompt": "x", "shift": "3"}', "shift"),
])
def test_prompt_file_lines_strictly_typed(tmp_path, line, field):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    ok, bad = parse_prompt_file(str(f), DEFAULTS)
    assert ok.request is not None and bad.request is None
    assert bad.error.startswith(f"{f} line 2: {field}:"), bad.error


def test_prompt_file_bom_and_csv_cells(tmp_path):
    t = tmp_path / "bom.txt"
    t.write_bytes("\ufeffa kite\n".encode("utf-8"))
    (line,) = parse_prompt_file(str(t), DEFAULTS)
    assert line.request.prompt == "a kite"
    c = tmp_path / "bom.csv"
    c.write_bytes("\ufeffprompt,steps\na kite,1\n".encode("utf-8"))
    (line,) = parse_prompt_file(str(c), {k: v for k, v in DEFAULTS.items() if k != "steps"})
    assert line.request.prompt == "a kite" and line.request.steps == 1
    x = tmp_path / "extra.csv"
    x.write_text("prompt,steps\na kite,1,oops\nfine,1\nbad steps,2.5\n")
    a, b, cc = parse_prompt_file(str(x), {k: v for k, v in DEFAULTS.items() if k != "steps"})
    assert a.request is None and "line 2" in a.error and "beyond the 2 header columns" in a.error
    assert b.request is not None
    assert cc.request is None and f"{x} line 4: steps:" in cc.error


# ------------------------------------------------------------------ store URLs (Python)
@pytest.mark.parametrize("url", ["", "gs://", "s3://"])
def test_store_urls_refused(url):
    with pytest.raises(StoreError):
        RunStore(url)


def test_vidax_batch_refuses_an_empty_file(tmp_path, capsys):
    f = tmp_path / "empty.txt"
    f.write_text("\n")
    assert cli.main(["batch", str(f), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vidax: error: file:") and "no prompts" in err
    assert not (tmp_path / "store").exists()


def test_subprocess_exit_code_and_single_line(tmp_path):
    """The installed command line gives exit 2 and one line on stderr (no traceback)."""
    p = subprocess.run([sys.executable, "-m", "flows.cli", "generate", *BASE, "--seed", "-3", "--store",
                        str(tmp_path / "s")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "seed:" in p.stderr, p.stderr
    assert not (tmp_path / "s").exists()
