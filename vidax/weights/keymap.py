"""Declarative key maps: reference tensor names -> vidax parameter paths, with layout transforms.

A :class:`KeyMap` is a list of :class:`Rule` s. ``src`` is the reference name; ``{i}`` in it marks a
repeated block whose tensors are **stacked** along a new leading axis of the vidax parameter (the
layout ``lax.scan`` and the offload runner consume). ``dst`` is a dotted path into the vidax
parameter tree. ``kind`` names the layout transform applied on the host:

===========  ===========================================  ==========================
kind         reference layout                             vidax layout
===========  ===========================================  ==========================
``none``     any                                          same
``linear``   ``[out, in]``                                ``[in, out]``
``conv1d``   ``[O, I, K]``                                ``[K, I, O]``
``conv2d``   ``[O, I, H, W]``                             ``[H, W, I, O]``
``conv3d``   ``[O, I, T, H, W]``                          ``[T, H, W, I, O]``
``flat``     ``[C, 1, ...]``                              ``[C]``
===========  ===========================================  ==========================
"""
from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from .io import Checkpoint, HeadersChecked, LazyTensor, _box, reading_headers_only  # noqa: F401 - re-exported

_TRANSFORMS = {
    "none": lambda a: a,
    "linear": lambda a: a.T,
    "conv1d": lambda a: a.transpose(2, 1, 0),
    "conv2d": lambda a: a.transpose(2, 3, 1, 0),
    "conv3d": lambda a: a.transpose(2, 3, 4, 1, 0),
    "flat": lambda a: a.reshape(a.shape[0]),
}
_SHAPE = {
    "none": lambda s: tuple(s),
    "linear": lambda s: tuple(s[::-1]) if len(s) == 2 else None,
    "conv1d": lambda s: (s[2], s[1], s[0]) if len(s) == 3 else None,
    "conv2d": lambda s: (s[2], s[3], s[1], s[0]) if len(s) == 4 else None,
    "conv3d": lambda s: (s[2], s[3], s[4], s[1], s[0]) if len(s) == 5 else None,
    "flat": lambda s: (s[0],) if len(s) >= 1 and all(d == 1 for d in s[1:]) else None,
}
#: each transform as an axis permutation (vidax axis j = reference axis PERM[j]); ``flat`` drops the 1s
_PERM = {"none": None, "linear": (1, 0), "conv1d": (2, 1, 0), "conv2d": (2, 3, 1, 0), "conv3d": (2, 3, 4, 1, 0),
         "flat": None}

_LAZY = contextvars.ContextVar("vidax_lazy_params", default=False)


@contextlib.contextmanager
def lazy_params(on: bool = True):
    """Inside this block :func:`load_params` reads nothing: every parameter comes back as a
    :class:`MappedTensor` that reads (and transforms, and casts) only the part a device asks for
    when it is placed (``vidax.core.sharding.place``: ``make_array_from_callback``), so each host
    reads only the rows of its own devices' shards and never holds a whole sharded tensor."""
    token = _LAZY.set(bool(on))
    try:
        yield
    finally:
        _LAZY.reset(token)


class MappedTensor:
    """A parameter in the vidax layout backed by checkpoint tensors (one, or one per stacked
    layer), read on demand: :meth:`read` with a basic index reads only the reference tensors' part
    that index needs (a safetensors slice), applies the layout transform and casts. ``reads``
    records each read's index (for tests). Anything else that needs its values (``np.asarray``)
    reads it whole."""

    def __init__(self, name: str, shape, dtype, kind: str, sources: dict, stacked: bool):
        self.name, self.shape, self.dtype = name, tuple(int(d) for d in shape), np.dtype(dtype)
        self.kind, self.sources, self.stacked = kind, sources, stacked
        self.reads: list = []

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def _one(self, t, box) -> np.ndarray:
        """The box ``box`` (unit-step slices in the vidax layout) of one reference tensor's transform."""
        perm = _PERM[self.kind]
        shape = tuple(t.shape)
        if self.kind == "flat":
            src = (box[0],) + (slice(None),) * (len(shape) - 1)
        elif perm is None:
            src = tuple(box)
        else:
            src = [slice(None)] * len(shape)
            for j, a in enumerate(perm):
                src[a] = box[j]
            src = tuple(src)
        part = t.read(index=src) if callable(getattr(t, "read", None)) else np.asarray(t)[src]
        return _TRANSFORMS[self.kind](part).astype(self.dtype)

    def read(self, index=None) -> np.ndarray:
        if reading_headers_only():
            raise HeadersChecked(self.name)
        self.reads.append(index)
        plan = _box(index if index is not None else (), self.shape)
        if plan is None:
            return self.read()[index]
        box, rest = plan
        if not self.stacked:
            out = self._one(self.sources[None], box)
        else:
            layers = range(box[0].start, box[0].stop)
            out = np.empty(tuple(s.stop - s.start for s in box), self.dtype)
            for k, i in enumerate(layers):
                out[k] = self._one(self.sources[i], box[1:])
        return np.asarray(out[rest])

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self):
        return f"MappedTensor({self.name}, {self.shape}, {self.dtype})"


# vidax shape -> the reference shape it comes from (for error messages)
_REF_SHAPE = {
    "none": lambda s: tuple(s),
    "linear": lambda s: tuple(s[::-1]),
    "conv1d": lambda s: (s[2], s[1], s[0]),
    "conv2d": lambda s: (s[3], s[2], s[0], s[1]),
    "conv3d": lambda s: (s[4], s[3], s[0], s[1], s[2]),
    "flat": lambda s: (s[0], "1..."),
}


@dataclass(frozen=True)
class Rule:
    src: str
    dst: str
    kind: str = "none"

    def __post_init__(self):
        if self.kind not in _TRANSFORMS:
            raise ValueError(f"rule {self.src!r}: unknown kind {self.kind!r}")

    @property
    def stacked(self) -> bool:
        return "{i}" in self.src

    def pattern(self) -> re.Pattern:
        parts = self.src.split("{i}")
        return re.compile("^" + r"(\d+)".join(re.escape(p) for p in parts) + "$")

    def name(self, i: int | None = None) -> str:
        return self.src.replace("{i}", str(i)) if self.stacked else self.src


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not match what the model expects."""




class KeyMap:
    def __init__(self, rules: Iterable[Rule], ignore: Iterable[str] = ()):
        self.rules = list(rules)
        self.ignore = [re.compile(p) for p in ignore]
        self._pats = [(r, r.pattern()) for r in self.rules]
        dsts = [r.dst for r in self.rules]
        dup = {d for d in dsts if dsts.count(d) > 1}
        if dup:
            raise ValueError(f"key map has several rules for {sorted(dup)}")

    def __add__(self, other: "KeyMap") -> "KeyMap":
        return KeyMap(self.rules + other.rules, [p.pattern for p in self.ignore + other.ignore])

    def match(self, name: str):
        for rule, pat in self._pats:
            m = pat.match(name)
            if m:
                return rule, (int(m.group(1)) if rule.stacked else None)
        return None, None

    def rename(self, names: Iterable[str], target: "KeyMap") -> dict[str, str]:
        """Map reference names under this map to the names ``target`` uses for the same parameter."""
        by_dst = {r.dst: r for r in target.rules}
        out = {}
        for n in names:
            rule, i = self.match(n)
            if rule is None:
                if any(p.search(n) for p in self.ignore):
                    continue
                raise KeyError(f"{n!r} is not covered by the key map")
            t = by_dst[rule.dst]
            if t.kind != rule.kind:
                raise ValueError(f"{n!r}: layouts differ between the two formats ({rule.kind} vs {t.kind})")
            out[n] = t.name(i)
        return out


def linear_rules(ref: str, dst: str, bias: bool = True) -> list[tuple[str, str, str]]:
    """The ``(src, dst, kind)`` rules of one linear layer: ``ref.weight`` -> ``dst.kernel`` (transposed)
    and, with ``bias``, ``ref.bias`` -> ``dst.bias``."""
    return [(f"{ref}.weight", f"{dst}.kernel", "linear")] + ([(f"{ref}.bias", f"{dst}.bias", "none")] if bias else [])


def int_keys(tree):
    """A nested dict from a key map's dotted paths with digit-string keys turned into ints (the
    indices of an ``nnx.List``)."""
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): int_keys(v) for k, v in tree.items()}
    return tree


def str_keys(tree):
    """A nested (shape) dict with every key a string (what a key map's dotted paths address)."""
    if isinstance(tree, dict):
        return {str(k): str_keys(v) for k, v in tree.items()}
    return tree


def _flatten(tree, prefix=""):
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _set(tree: dict, path: str, value):
    keys = path.split(".")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _fmt(items, n=5):
    items = list(items)
    more = f", ... ({len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def mismatch_error(source: str, what: str, missing=(), unexpected=(), misshaped=()) -> CheckpointMismatchError:
    """The one error for a checkpoint that does not fit: counts and the first few of each kind."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {_fmt(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {_fmt(sorted(unexpected))}")
    if misshaped:
        parts.append(f"{len(misshaped)} mis-shaped: {_fmt(misshaped)}")
    return CheckpointMismatchError(f"{source} does not fit {what}: " + "; ".join(parts))


def load_params(
    ckpt: Checkpoint | Mapping[str, np.ndarray],
    keymap: KeyMap,
    like,
    dtype=None,
    what: str = "model",
):
    """Build a vidax parameter tree from a checkpoint.

    ``like``: a pytree (nested dicts) of arrays or ``jax.ShapeDtypeStruct`` giving every expected
    parameter's shape. Tensors are read one at a time, transformed and cast on the host.
    Raises :class:`CheckpointMismatchError` listing missing, unexpected and mis-shaped tensors.
    """
    expected = dict(_flatten(like))
    by_dst = {r.dst: r for r in keymap.rules}
    unexpected, misshaped = [], []
    found: dict[str, dict] = {}
    for name in ckpt:
        rule, i = keymap.match(name)
        if rule is None or rule.dst not in expected:
            if not any(p.search(name) for p in keymap.ignore):
                unexpected.append(name)
            continue
        t = ckpt[name]
        shape = tuple(t.shape) if isinstance(t, LazyTensor) else tuple(np.shape(t))
        want = tuple(expected[rule.dst].shape)
        if rule.stacked:
            if not want or i >= want[0]:
                unexpected.append(name)
                continue
            want = want[1:]
        got = _SHAPE[rule.kind](shape)
        if got != want:
            # report in the reference's layout
            exp = ", ".join(str(d) for d in _REF_SHAPE[rule.kind](want))
            where = getattr(t, "file", None)
            misshaped.append(f"{name} (shape {list(shape)}, expected [{exp}]" + (f", in {where}" if where else "") + ")")
            found.setdefault(rule.dst, {})[i] = None
            continue
        found.setdefault(rule.dst, {})[i] = t
    missing = []
    for dst, leaf in expected.items():
        rule = by_dst.get(dst)
        if rule is None:
            missing.append(f"<no rule for {dst}>")
            continue
        have = found.get(dst, {})
        if rule.stacked:
            missing.extend(rule.name(i) for i in range(leaf.shape[0]) if i not in have)
        elif None not in have:
            missing.append(rule.name())
    if missing or unexpected or misshaped:
        raise mismatch_error(getattr(ckpt, "source", "checkpoint"), what, missing, unexpected, misshaped)
    if reading_headers_only():
        raise HeadersChecked(what)

    def read(t):
        a = t.read() if isinstance(t, LazyTensor) else np.asarray(t)
        return a

    out: dict = {}
    lazy = _LAZY.get()
    for dst, leaf in expected.items():
        rule = by_dst[dst]
        tgt = np.dtype(dtype) if dtype is not None else np.dtype(leaf.dtype)
        if lazy:
            _set(out, dst, MappedTensor(dst, leaf.shape, tgt, rule.kind, found[dst], rule.stacked))
            continue
        fn = _TRANSFORMS[rule.kind]
        if rule.stacked:
            arr = np.empty(tuple(leaf.shape), tgt)
            for i, t in found[dst].items():
                arr[i] = fn(read(t)).astype(tgt)
        else:
            arr = np.ascontiguousarray(fn(read(found[dst][None])).astype(tgt))
        _set(out, dst, arr)
    return out


def load_checkpoint_params(ckpt, cfg, *, is_original, config_from_original, keymap, shapes, dtype, what, source,
                           view=None):
    """The shared two-format loader: pick the original-release or diffusers/transformers key map from
    the tensor names, infer ``cfg`` from an original checkpoint's shapes when none was given, and
    build the host parameter tree. ``keymap(cfg, original: bool) -> KeyMap``; ``what(cfg)`` names
    the model in errors; ``view(ckpt, cfg, original)``, when given, is the checkpoint as ``keymap``
    reads it (e.g. an original release under the diffusers names). Returns ``(params, cfg)``."""
    original = is_original(list(ckpt))
    if cfg is None:
        if not original:
            raise ValueError(f"{source}: no config.json; pass the model config")
        cfg = config_from_original(ckpt)
    if view is not None:
        ckpt = view(ckpt, cfg, original)
    params = load_params(ckpt, keymap(cfg, original), shapes(cfg), dtype=dtype, what=what(cfg))
    return params, cfg
