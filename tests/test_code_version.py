"""The code part of the stage keys (``stages/run.py``: ``code_version``): a file's digest is its
syntax tree without docstrings, kept by the file's bytes in this process and in ``<cache>/code``."""
from __future__ import annotations

import subprocess
import sys

from stages import run as R
from tests.children import ENV


def _digest(path, text):
    path.write_text(text)
    return R._source_digest(path)


def test_comments_and_docstrings_do_not_change_the_digest_code_does(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.py"
    base = _digest(f, 'def f(x):\n    return x + 1\n')
    assert _digest(f, '"""A module."""\n# a comment\ndef f(x):\n    """Adds one."""\n    return x + 1  # one\n') == base
    assert _digest(f, 'def f(x):\n    return x + 2\n') != base
    assert _digest(f, 'def f(y):\n    return y + 1\n') != base


def test_a_digest_is_kept_by_the_files_bytes_for_the_next_process(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("VIDAX_CACHE", str(cache))
    f = tmp_path / "m.py"
    d = _digest(f, 'X = [1, 2]\n')
    kept = list((cache / "code").iterdir())
    assert len(kept) == 1 and kept[0].read_text() == d
    # another process reads it instead of parsing: a planted digest shows which way it went
    kept[0].write_text("f" * 64)
    code = "import sys; from pathlib import Path; from stages import run as R; print(R._source_digest(Path(sys.argv[1])))"
    out = subprocess.run([sys.executable, "-c", code, str(f)], env={**ENV, "VIDAX_CACHE": str(cache)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "f" * 64
    # a damaged entry is parsed again and replaced
    kept[0].write_text("garbage")
    out = subprocess.run([sys.executable, "-c", code, str(f)], env={**ENV, "VIDAX_CACHE": str(cache)},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == d and kept[0].read_text() == d


def test_an_unwritable_cache_only_costs_the_parse(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("VIDAX_CACHE", str(blocker))  # a file where the folder would be
    f = tmp_path / "m.py"
    assert _digest(f, 'Y = 3\n') == R._parse_digest(b'Y = 3\n')
