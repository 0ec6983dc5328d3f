"""Prompt files for batch generation, at any fsspec URL:

- ``.txt``: one prompt a line (blank lines and ``#`` comments skipped);
- ``.jsonl``: one JSON object a line: ``prompt`` plus any request field or model option;
- ``.csv``: a ``prompt`` column plus override columns (empty cells keep the default).

Every line is validated before anything runs; a bad line is reported with the file and its line
number and does not stop the others. Types are strict: ``steps: 2.7`` or ``steps: true`` are
errors, never 2 or 1.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass

import fsspec

from stages.request import Request, RequestError, validate
from vidax import registry
from vidax.pipeline import OptionError

_FIELD_TYPES = {"seed": int, "height": int, "width": int, "num_frames": int, "steps": int, "decode_stages": int,
                "checkpoint_every": int, "guidance": float, "fps": float, "cache_threshold": float,
                "cache_max_skips": int, "cache_retention": float, "cache_interval": int, "cache_warmup": int,
                "cache_order": int}


class PromptFileError(ValueError):
    """The prompt file as a whole cannot be used (unreadable, empty, unknown type, bad header)."""


#: prompt-file keys named as the CLI's flags are, beside the request's own field names
ALIASES = {"frames": "num_frames"}


def canonical(key: str) -> str:
    """A prompt-file key as the request field it sets: a flag's name (``frames``,
    ``negative-prompt``, ``--decode-stages``) or the field's own name (``num_frames``)."""
    k = key.strip().lstrip("-").replace("-", "_") if isinstance(key, str) else key
    return ALIASES.get(k, k)


@dataclass
class BatchLine:
    line: int
    request: Request | None = None
    error: str | None = None
    run_id: str | None = None  # the line's ``run_id`` key (as ``--run-id``); None: derived from the request


def read_text(url: str) -> str:
    try:
        with fsspec.open(url, "rt", encoding="utf-8-sig") as f:  # a UTF-8 BOM is not part of the text
            return f.read()
    except FileNotFoundError:
        raise PromptFileError(f"{url}: no such file") from None
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{url}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _typed(name: str, value, model: str):
    """A CSV cell (text) as the field's or option's type (as the CLI reads the flag's text)."""
    if name == "cache_ratios":  # ``1.0,0.98,...`` a list, as --cache-ratios takes it; else a file
        from stages.cli import _ratios_arg

        return _ratios_arg(value)
    if name in _FIELD_TYPES:
        t = _FIELD_TYPES[name]
        try:
            return t(value.strip()) if t is int else float(value)
        except ValueError:
            raise RequestError(name,
                               f"{value!r} is not a{'n' if t is int else ''} {'integer' if t is int else 'number'}") from None
    recipe = registry.MODELS.get(model)
    opt = recipe.option(name) if recipe is not None else None
    if opt is not None:
        try:
            return opt.parse(value)
        except OptionError as e:
            raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
    return value


def _keys(obj: dict) -> dict:
    """``obj`` with every key under its request-field name; two keys for one field are an error."""
    out, given = {}, {}
    for k, v in obj.items():
        c = canonical(k)
        if c in out:
            raise RequestError(c, f"given twice (as {given[c]!r} and {k!r})")
        out[c], given[c] = v, k
    return out


def _request(base: dict, over: dict, from_text: bool) -> tuple[Request, str | None]:
    d = _keys(base)
    over = _keys(over)
    model = over.get("model") or d.get("model") or registry.default_model()
    run_id = over.pop("run_id", None)
    if from_text and run_id == "":
        run_id = None
    for k, v in over.items():
        if from_text:
            if v is None or v == "":
                continue
            v = _typed(k, v, model)
        d[k] = v
    if run_id is not None:
        from stages.request import validate_run_id

        validate_run_id(run_id)
    return validate(Request.from_json(d)), run_id


def parse_prompt_file(url: str, defaults: dict | None = None) -> list[BatchLine]:
    """Parse and validate every line; returns one :class:`BatchLine` per prompt line. Raises
    :class:`PromptFileError` for a file that holds no prompt lines at all."""
    kind = url.rsplit(".", 1)[-1].lower() if "." in url.rsplit("/", 1)[-1] else ""
    if kind not in ("txt", "jsonl", "csv"):
        raise PromptFileError(f"{url}: unknown prompt file type {'.' + kind if kind else '(no extension)'}; "
                              f"use .txt, .jsonl or .csv")
    text = read_text(url)
    base = dict(defaults or {})
    out: list[BatchLine] = []
    if kind == "csv":
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or "prompt" not in [f.strip() for f in reader.fieldnames]:
            raise PromptFileError(f"{url}: a CSV prompt file needs a 'prompt' column (header: {reader.fieldnames})")
        for row in reader:
            i = reader.line_num
            if None in row:  # more cells than header columns
                out.append(BatchLine(i, error=f"{url} line {i}: {len(row[None])} cell(s) beyond the "
                                              f"{len(reader.fieldnames)} header columns"))
                continue
            if not any((v or "").strip() for v in row.values()):
                continue
            out.append(_line(url, i, lambda row=row: _request(base, {k.strip(): v for k, v in row.items()}, True)))
    else:
        for i, raw in enumerate(text.splitlines(), start=1):
            s = raw.strip()
            if not s or (kind == "txt" and s.startswith("#")):
                continue
            if kind == "jsonl":
                def make(s=s):
                    try:
                        obj = json.loads(s)
                    except json.JSONDecodeError as e:
                        raise RequestError("line", f"not valid JSON ({e.msg})") from None
                    if not isinstance(obj, dict):
                        raise RequestError("line", "must be a JSON object with a 'prompt'")
                    return _request(base, obj, False)
                out.append(_line(url, i, make))
            else:
                out.append(_line(url, i, lambda s=s: _request(base, {"prompt": s}, False)))
    if not out:
        raise PromptFileError(f"{url}: no prompts (the file is empty or holds only blank lines and comments)")
    return out


def _line(url: str, i: int, make) -> BatchLine:
    try:
        req, run_id = make()
        return BatchLine(i, request=req, run_id=run_id)
    except (RequestError, TypeError, ValueError) as e:
        return BatchLine(i, error=f"{url} line {i}: {e}")
