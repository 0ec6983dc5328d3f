"""Prompt files for batch generation: ``.txt`` (one prompt a line), ``.jsonl`` (one JSON object a
line: ``prompt`` plus any request field as an override) or ``.csv`` (a ``prompt`` column plus
override columns). Every line is validated before anything runs; bad lines are reported with
their line numbers."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, fields

import fsspec

from stages.request import Request, RequestError, validate

_FIELDS = {f.name: f.type for f in fields(Request)}
_INT = {"seed", "height", "width", "num_frames", "steps", "decode_stages", "checkpoint_every"}
_FLOAT = {"guidance", "shift", "fps"}


@dataclass
class BatchLine:
    line: int
    request: Request | None = None
    error: str | None = None


def read_text(url: str) -> str:
    with fsspec.open(url, "rt", encoding="utf-8") as f:
        return f.read()


def _coerce(name: str, value):
    if value in ("", None):
        return None
    if name in _INT:
        return int(value)
    if name in _FLOAT:
        return float(value)
    return value


def _request(base: dict, over: dict) -> Request:
    unknown = sorted(set(over) - set(_FIELDS))
    if unknown:
        raise RequestError(unknown[0], "unknown field")
    d = dict(base)
    for k, v in over.items():
        try:
            v = _coerce(k, v)
        except (TypeError, ValueError):
            raise RequestError(k, f"{v!r} is not a valid {('integer' if k in _INT else 'number')}") from None
        if v is not None:
            d[k] = v
    return validate(Request(**d))


def parse_prompt_file(url: str, defaults: dict | None = None) -> list[BatchLine]:
    """Parse and validate every line; returns one :class:`BatchLine` per prompt line."""
    text = read_text(url)
    base = dict(defaults or {})
    out: list[BatchLine] = []
    kind = url.rsplit(".", 1)[-1].lower()
    if kind == "csv":
        reader = csv.DictReader(io.StringIO(text))
        if not reader.fieldnames or "prompt" not in reader.fieldnames:
            raise ValueError(f"{url}: a CSV prompt file needs a 'prompt' column (got {reader.fieldnames})")
        for i, row in enumerate(reader, start=2):
            if not any((v or "").strip() for v in row.values()):
                continue
            out.append(_line(i, lambda row=row: _request(base, {k: v for k, v in row.items() if k})))
        return out
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
                return _request(base, obj)
            out.append(_line(i, make))
        elif kind == "txt":
            out.append(_line(i, lambda s=s: _request(base, {"prompt": s})))
        else:
            raise ValueError(f"{url}: unknown prompt file type .{kind} (use .txt, .jsonl or .csv)")
    return out


def _line(i: int, make) -> BatchLine:
    try:
        return BatchLine(i, request=make())
    except (RequestError, TypeError, ValueError) as e:
        return BatchLine(i, error=str(e))
