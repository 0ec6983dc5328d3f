"""LoRA adapters, merged into a checkpoint's tensors on the host at load.

A LoRA file (``.safetensors`` only: pickles are refused) is read with the ``safetensors`` library
and grouped by module. The layouts people download are accepted:

- diffusers / PEFT: ``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` (+ ``lora_B.bias``);
- ComfyUI / kohya: ``diffusion_model.<original name>.lora_down.weight`` / ``lora_up.weight`` +
  ``.alpha``, and the flattened ``lora_unet_<original_name_with_underscores>.*`` (musubi-tuner
  writes this one); AI-Toolkit: ``diffusion_model.<original name>.lora_A/lora_B.weight``;
- LyCORIS-style full deltas: ``<module>.diff`` (the weight) and ``<module>.diff_b`` (the bias).

Module names are resolved against the checkpoint's own tensor names through a family's **alias
table** (``alias name -> checkpoint tensor name``, built from the family's key maps: a diffusers
checkpoint also answers to the original release's names, and the other way round).

Merge, per target tensor ``W`` (its reference layout, in float32, before any cast or placement)::

    W + scale * (alpha / rank) * up @ down          (alpha: the file's ``.alpha``, else its PEFT
                                                     ``lora_adapter_metadata``, else rank)
    b + scale * diff_b,  W + scale * diff           (and b + scale * (alpha / rank) * lora_B.bias)

A fused module of one layout (HunyuanVideo's ``img_attn_qkv``) adapts row ranges of the separate
tensors of the other (:class:`Delta` ``rows``). Several LoRAs add. A model's :class:`Target` s are
its experts (each takes a LoRA whole) or components claiming module prefixes (LTX-2's connectors).
The merge hooks into :func:`vidax.weights.open_checkpoint`: inside ``with merging(target,
specs):`` the checkpoint opened at ``target.path`` reads merged tensors, so every family's loader,
key map, cast and sharded placement stay as they are.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .io import Checkpoint, LazyTensor

#: prefixes a LoRA's names carry before the module path (longest first)
PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.")
#: flattened (kohya) prefixes: the module path follows with "." written as "_"
FLAT_PREFIXES = ("lora_unet_", "lora_transformer_")
#: suffix -> role
SUFFIXES = (
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"), (".lora_B.bias", "up_bias"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".alpha", "alpha"), (".diff_b", "diff_b"), (".diff", "diff"),
)
_PICKLE_EXT = (".pt", ".pth", ".bin", ".ckpt", ".pkl")


class LoraError(ValueError):
    """A LoRA that cannot be applied: the message names the file and the keys."""


# ------------------------------------------------------------------------------ the request side
@dataclass(frozen=True)
class LoraSpec:
    """One ``--lora [TARGET=]FILE[:SCALE]``: ``target`` None applies to every DiT of the model (both
    experts of Wan2.2 A14B), else a family's target name (``high`` / ``low``)."""

    path: str
    scale: float = 1.0
    target: str | None = None

    def __str__(self) -> str:
        short = f"{self.scale:g}"
        scale = short if float(short) == self.scale else repr(float(self.scale))  # exact, short when it can be
        return (f"{self.target}=" if self.target else "") + f"{self.path}:{scale}"


_TARGET_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.+)$")


def parse_spec(text) -> LoraSpec:
    """``[TARGET=]FILE[:SCALE]``; FILE may be a URL (``gs://b/x.safetensors:0.8``): the scale is the
    text after the last ``:`` only when it reads as a number."""
    if isinstance(text, LoraSpec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise LoraError(f"{text!r}: give FILE[:SCALE] (or high=FILE[:SCALE] / low=FILE[:SCALE])")
    s, target = text.strip(), None
    m = _TARGET_RE.match(s)
    if m and "://" not in m.group(1):
        target, s = m.group(1), m.group(2)
    path, scale = s, 1.0
    if ":" in s:
        head, tail = s.rsplit(":", 1)
        try:
            scale = float(tail)
            path = head
        except ValueError:
            pass
    if not path:
        raise LoraError(f"{text!r}: no file")
    if not math.isfinite(scale) or abs(scale) > 100:
        raise LoraError(f"{text!r}: scale {scale} must be a finite number in [-100, 100]")
    return LoraSpec(path, float(scale), target)


def parse_specs(value) -> list[LoraSpec]:
    """A request's ``lora`` field (None, one string, or a list of strings) as specs."""
    if value is None:
        return []
    items = [value] if isinstance(value, (str, LoraSpec)) else value
    if not isinstance(items, (list, tuple)):
        raise LoraError(f"{value!r}: give FILE[:SCALE] or a list of them")
    return [parse_spec(v) for v in items]


def local_file(spec: LoraSpec) -> Path:
    """The LoRA file on local disk (a URL is fetched once into the checkpoint cache)."""
    from .source import is_url, local_path, resolve_source

    p = resolve_source(spec.path) if is_url(spec.path) else local_path(spec.path)
    if not p.is_file():
        raise LoraError(f"{spec.path}: no such file")
    return p


def fingerprint(spec: LoraSpec) -> list:
    """What enters a stage key for this LoRA: its content fingerprint, scale and target (never its
    path: the same file fetched from another URL gives the same key)."""
    from .fingerprint import file_fingerprint

    return [spec.target, file_fingerprint(local_file(spec)), float(spec.scale)]


# ------------------------------------------------------------------------------ reading a LoRA file
def read_file(path: Path, shown: str | None = None) -> dict[str, LazyTensor]:
    """Every tensor of a LoRA file (lazy). Pickles and damaged files raise :class:`LoraError`."""
    from .io import CheckpointFormatError, _safetensors_file

    shown = shown or str(path)
    with open(path, "rb") as f:
        head = f.read(8)
    if path.name.lower().endswith(_PICKLE_EXT) or head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        raise LoraError(f"{shown}: a pickle (PyTorch .pt/.pth/.bin/.ckpt); only .safetensors LoRAs are read "
                        f"(no code from a downloaded file runs here): convert it to safetensors first")
    try:
        tensors = _safetensors_file(path)
    except CheckpointFormatError as e:
        why = str(e).split(": ", 1)[-1]
        why = why if why.startswith("not a readable") else f"not a readable safetensors file ({why})"
        raise LoraError(f"{shown}: {why}") from None
    if not tensors:
        raise LoraError(f"{shown}: holds no tensors")
    return tensors


def peft_config(path: Path, shown: str) -> dict | None:
    """The PEFT ``LoraConfig`` a diffusers / PEFT file may carry in its safetensors metadata
    (``lora_adapter_metadata``: ``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern``)."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        raw = (f.metadata() or {}).get("lora_adapter_metadata")
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
        assert isinstance(cfg, dict)
    except (ValueError, AssertionError):
        raise LoraError(f"{shown}: its lora_adapter_metadata is not a JSON object") from None
    if any(k.startswith("transformer.") for k in cfg):  # a pipeline's save_lora_weights: per component
        cfg = {k.removeprefix("transformer."): v for k, v in cfg.items() if k.startswith("transformer.")}
    if cfg.get("use_dora"):
        raise LoraError(f"{shown}: a DoRA adapter (use_dora); only plain LoRA weights can be merged")
    return cfg


def _pattern(patterns: dict, module: str):
    for pat, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pat})$", module):
            return v
    return None


def peft_factor(cfg: dict, module: str, rank: int) -> float:
    """alpha / r (or alpha / sqrt(r) with rsLoRA) of ``module`` under a PEFT config."""
    r = _pattern(cfg.get("rank_pattern"), module) or cfg.get("r") or rank
    alpha = _pattern(cfg.get("alpha_pattern"), module) or cfg.get("lora_alpha") or r
    return float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else float(r))


@dataclass
class Module:
    """One adapted module of a LoRA file: its tensors by role, and the file's names for them."""

    name: str  # as in the file, prefixes and suffix removed
    flat: bool  # a kohya-flattened name ("_" for ".")
    parts: dict = field(default_factory=dict)  # role -> LazyTensor
    keys: list = field(default_factory=list)  # the file's tensor names


def modules(tensors: Mapping[str, LazyTensor], shown: str) -> dict[str, Module]:
    out: dict[str, Module] = {}
    unknown = []
    for key, t in tensors.items():
        role = next((r for suf, r in SUFFIXES if key.endswith(suf)), None)
        if role is None:
            unknown.append(key)
            continue
        base = key[: -len(next(suf for suf, r in SUFFIXES if key.endswith(suf)))]
        flat = False
        for p in FLAT_PREFIXES:
            if base.startswith(p):
                base, flat = base[len(p):], True
                break
        else:
            for p in PREFIXES:
                if base.startswith(p):
                    base = base[len(p):]
                    break
        m = out.setdefault(base, Module(base, flat))
        if role in m.parts:
            raise LoraError(f"{shown}: module {base!r} has two {role} tensors ({', '.join(m.keys)}, {key})")
        m.parts[role], m.keys = t, m.keys + [key]
    if unknown:
        raise LoraError(f"{shown}: {len(unknown)} key(s) of no LoRA layout (expected lora_A/lora_B, lora_down/lora_up "
                        f"+ alpha, diff, diff_b): {_few(unknown)}")
    return out


def _few(items, n=4) -> str:
    items = sorted(items)
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


# ------------------------------------------------------------------------------ resolution
@dataclass(frozen=True)
class Target:
    """A checkpoint a LoRA can adapt: ``path`` (what the loader passes to ``open_checkpoint``),
    ``aliases(shapes)`` (the family's table from the checkpoint's ``{name: shape}``: alternative
    tensor names -> the checkpoint's names, or for a fused module of another layout a tuple of
    ``(name, src0, src1, dst0, dst1)`` row ranges, see :class:`Delta`)."""

    name: str
    path: Path
    aliases: Callable[[Sequence[str]], dict[str, str]]
    what: str
    #: module-name prefixes this target takes (stripped before its alias table): a LoRA's modules
    #: under them go here only; modules under no target's claims go to the targets without claims
    #: (a model's components split a LoRA, its experts each take it whole)
    claims: tuple = ()
    #: the stage kind whose key the LoRAs of this target enter
    stage: str = "sample"


@dataclass
class Delta:
    """What one LoRA adds to one checkpoint tensor (reference layout): ``kind`` "lowrank"
    (``factor * up @ down``) or "full" (``factor * tensor``); ``rows``: ``(src0, src1, dst0, dst1)``
    when the LoRA adapts a fused module of another layout and rows ``src0:src1`` of its update are
    rows ``dst0:dst1`` of this tensor (None: the whole tensor)."""

    kind: str
    tensors: tuple
    factor: float
    rows: tuple | None = None


def _parts(alias) -> list:
    """An alias table value as ``[(tensor name, (src0, src1, dst0, dst1) | None)]``: a name is the
    whole tensor; a tuple of ``(name, src0, src1, dst0, dst1)`` splits a fused module's rows."""
    if isinstance(alias, str):
        return [(alias, None)]
    return [(t, (a0, a1, b0, b1)) for t, a0, a1, b0, b1 in alias]


def _place(out: dict, alias, shape: tuple, ckpt_shapes: Mapping[str, tuple], delta: Delta) -> str | None:
    """Add ``delta`` (an update of ``shape``) to ``out`` under ``alias``; a mismatch as text."""
    parts = _parts(alias)
    if parts[0][1] is None:
        name = parts[0][0]
        if shape != tuple(ckpt_shapes[name]):
            return f"the model's {name} is {list(ckpt_shapes[name])}"
        out.setdefault(name, []).append(delta)
        return None
    rows = max(r[1] for _, r in parts)
    for name, (a0, a1, b0, b1) in parts:
        t = tuple(ckpt_shapes[name])
        if rows != shape[0] or shape[1:] != t[1:] or b1 > t[0] or a1 - a0 != b1 - b0:
            return f"the model's {', '.join(n for n, _ in parts)} are {[list(ckpt_shapes[n]) for n, _ in parts]}"
    for name, r in parts:
        out.setdefault(name, []).append(Delta(delta.kind, delta.tensors, delta.factor, r))
    return None


def identity_aliases(names: Sequence[str]) -> dict[str, str]:
    return {n: n for n in names}


def keymap_aliases(names: Sequence[str], own, others: Iterable) -> dict[str, str]:
    """Alias table from key maps: every checkpoint name as itself, and under each of ``others``
    (:class:`~vidax.weights.KeyMap`) the name that map gives the same parameter (same layout)."""
    out = {n: n for n in names}
    other_rules = [{r.dst: r for r in km.rules} for km in others]
    for n in names:
        rule, i = own.match(n)
        if rule is None:
            continue
        for table in other_rules:
            alt = table.get(rule.dst)
            if alt is not None and alt.kind == rule.kind and alt.stacked == rule.stacked:
                out.setdefault(alt.name(i), n)
    return out


def two_layout_aliases(diffusers_map, original_map, is_original: Callable[[Sequence[str]], bool],
                       release_prefix: str = "model.diffusion_model."):
    """The alias table of a family with a diffusers and an original-release key map (the same
    parameters under two sets of names): ``names -> {alias: name}`` answering to both, whichever
    layout the checkpoint has (its names may carry ``release_prefix``, as single-file releases do)."""

    def table(names):
        bare = {n.removeprefix(release_prefix): n for n in names}
        own, other = (original_map, diffusers_map) if is_original(list(bare)) else (diffusers_map, original_map)
        return {a: bare[n] for a, n in keymap_aliases(list(bare), own, [other]).items()}

    return table


def claimed(mods: Mapping[str, Module], target: Target, targets: Sequence[Target] = ()) -> dict[str, Module]:
    """The modules of a LoRA that go to ``target`` (claim prefixes stripped), ``targets`` being
    all the model's targets the LoRA applies to."""
    out = {}
    others = [c for t in targets for c in t.claims]
    for name, m in mods.items():
        if target.claims:
            pre = next((c for c in target.claims if name.startswith(c)), None)
            if pre is not None:
                out[name[len(pre):]] = Module(name[len(pre):], m.flat, m.parts, m.keys)
        elif not any(name.startswith(c) for c in others):
            out[name] = m
    return out


def resolve(lora, shown: str, scale: float, ckpt_shapes: Mapping[str, tuple],
            aliases: Mapping, what: str, peft: dict | None = None) -> dict[str, list[Delta]]:
    """``{checkpoint tensor name: [Delta]}`` for one LoRA file (its tensors, or its modules already
    grouped), or :class:`LoraError` naming the keys that match no module of the model and the
    shapes that do not fit."""
    first = next(iter(lora.values()), None)
    mods = lora if isinstance(first, Module) else modules(lora, shown)
    flat_index: dict[str, str | None] = {}
    for a in aliases:
        for suf in (".weight", ".bias"):
            if a.endswith(suf):
                k = a[: -len(suf)].replace(".", "_")
                mod = a[: -len(suf)]
                flat_index[k] = mod if flat_index.get(k, mod) == mod else None  # None: ambiguous
    out: dict[str, list[Delta]] = {}
    unmatched, misshaped, incomplete = [], [], []
    for m in mods.values():
        name = flat_index.get(m.name) if m.flat else m.name
        w = aliases.get(f"{name}.weight") if name else None
        b = aliases.get(f"{name}.bias") if name else None
        p = m.parts
        wants_w = {"down", "up", "diff"} & set(p)
        wants_b = {"diff_b", "up_bias"} & set(p)
        if (wants_w and w is None) or (wants_b and b is None) or (not wants_w and not wants_b):
            unmatched.extend(m.keys)
            continue
        if ("down" in p) != ("up" in p):
            incomplete.append(f"{m.name} (has {'down' if 'down' in p else 'up'} without its pair)")
            continue
        if "up_bias" in p and "down" not in p:
            incomplete.append(f"{m.name} (lora_B.bias without lora_A/lora_B weights)")
            continue
        factor = scale
        if "down" in p:
            down, up = p["down"], p["up"]
            rank = down.shape[0] if down.shape else 0
            if not rank or len(up.shape) < 2 or up.shape[1] != rank or math.prod(up.shape[2:]) != 1:
                misshaped.append(f"{m.name} (down {list(down.shape)}, up {list(up.shape)}: ranks differ)")
                continue
            if "alpha" in p:
                a = np.asarray(p["alpha"].read(), np.float64)
                if a.size != 1 or not np.isfinite(a).all():
                    misshaped.append(f"{m.name} (alpha {a.tolist()!r:.40} is not one finite number)")
                    continue
                alpha = float(a.reshape(()))
                factor = scale * alpha / rank
            elif peft is not None:
                factor = scale * peft_factor(peft, m.name, rank)
            full = (up.shape[0],) + tuple(down.shape[1:])
            bad = _place(out, w, full, ckpt_shapes, Delta("lowrank", (up, down), factor))
            if bad:
                misshaped.append(f"{m.name} (gives {list(full)}, {bad})")
                continue
            if "up_bias" in p:
                bad = _place(out, b, tuple(p["up_bias"].shape), ckpt_shapes, Delta("full", (p["up_bias"],), factor))
                if bad:
                    misshaped.append(f"{m.name}.lora_B.bias ({list(p['up_bias'].shape)}, {bad})")
                    continue
        for role, tgt in (("diff", w), ("diff_b", b)):
            if role in p:
                bad = _place(out, tgt, tuple(p[role].shape), ckpt_shapes, Delta("full", (p[role],), scale))
                if bad:
                    misshaped.append(f"{m.name}.{role} ({list(p[role].shape)}, {bad})")
    problems = []
    if unmatched:
        problems.append(f"{len(unmatched)} key(s) match no module of {what}: {_few(unmatched)}")
    if misshaped:
        problems.append(f"{len(misshaped)} shape mismatch(es): {_few(misshaped, 3)}")
    if incomplete:
        problems.append(f"{len(incomplete)} incomplete module(s): {_few(incomplete, 3)}")
    if problems:
        raise LoraError(f"{shown}: " + "; ".join(problems))
    return out


def plan(specs: Sequence[LoraSpec], target: Target, ckpt: Mapping[str, LazyTensor] | None = None,
         targets: Sequence[Target] = ()) -> dict[str, list[Delta]]:
    """Every delta that ``specs`` add to ``target``'s tensors (headers read; data read at merge);
    ``targets``: every target of the model (which modules other targets claim)."""
    from .io import open_checkpoint

    out: dict[str, list[Delta]] = {}
    shapes = aliases = None
    for spec in specs:
        path = local_file(spec)
        mods = claimed(modules(read_file(path, spec.path), spec.path), target, targets)
        if not mods:
            continue  # nothing of this LoRA goes to this target: its checkpoint is not opened
        if shapes is None:
            ckpt = ckpt if ckpt is not None else open_checkpoint(target.path)
            shapes = {n: tuple(t.shape) for n, t in ckpt.items()}
            aliases = target.aliases(shapes)  # name -> shape (iterates as the names)
        peft = peft_config(path, spec.path)
        for name, ds in resolve(mods, spec.path, spec.scale, shapes, aliases, target.what, peft).items():
            out.setdefault(name, []).extend(ds)
    return out


def stages_touched(spec: LoraSpec, targets: Mapping[str, Target]) -> set[str]:
    """The stage kinds whose weights ``spec`` changes (headers read)."""
    mods = modules(read_file(local_file(spec), spec.path), spec.path)
    names = applies_to(spec, targets)
    return {targets[t].stage for t in names if claimed(mods, targets[t], [targets[n] for n in names])}


def add_delta(w: np.ndarray, d: Delta) -> None:
    """``w += d`` in place (float32; ``d.rows``: only those rows)."""
    a0, a1, b0, b1 = d.rows if d.rows is not None else (0, w.shape[0], 0, w.shape[0])
    if d.kind == "lowrank":
        up, down = (np.asarray(t.read(), np.float32) for t in d.tensors)
        r = down.shape[0]
        upd = up.reshape(up.shape[0], r)[a0:a1] @ down.reshape(r, -1)
    else:
        upd = np.asarray(d.tensors[0].read(), np.float32)[a0:a1]
    w[b0:b1] += (d.factor * upd).reshape((b1 - b0,) + w.shape[1:])


def merged(ckpt: Checkpoint, deltas: Mapping[str, list[Delta]]) -> Checkpoint:
    """``ckpt`` with the tensors named in ``deltas`` read as float32 ``W + sum(deltas)``."""
    tensors = dict(ckpt.items())
    for name, ds in deltas.items():
        base = tensors[name]

        def read(base=base, ds=ds):
            w = np.array(base.read(), np.float32)
            for d in ds:
                add_delta(w, d)
            return w

        tensors[name] = LazyTensor(name, tuple(base.shape), np.dtype(np.float32), read)
    return Checkpoint(tensors, ckpt.source)


# ------------------------------------------------------------------------------ the load hook
@dataclass
class _Active:
    path: Path
    specs: tuple
    target: Target
    targets: tuple = ()
    used: int = 0


_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("vidax_lora_active", default=())


def _key(p) -> Path:
    from .source import local_path

    return local_path(p).resolve()


@contextlib.contextmanager
def merging(target: Target, specs: Sequence[LoraSpec], targets: Sequence[Target] = ()):
    """Inside this block, ``open_checkpoint(target.path)`` returns the checkpoint with ``specs``
    merged. Raises on exit if the loader never opened ``target.path`` (a loader that reads its
    weights another way would silently drop the LoRA)."""
    specs = tuple(specs)
    if not specs:
        yield
        return
    act = _Active(_key(target.path), specs, target, tuple(targets))
    token = _ACTIVE.set(_ACTIVE.get() + (act,))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
    if not act.used:
        raise RuntimeError(f"LoRA merge: the loader never opened {target.path}; the LoRA(s) were not applied")


def apply_active(ckpt: Checkpoint, path) -> Checkpoint:
    """Called by :func:`vidax.weights.open_checkpoint` for every checkpoint it opens."""
    active = _ACTIVE.get()
    if not active:
        return ckpt
    k = _key(path)
    for act in active:
        if act.path == k:
            act.used += 1
            return merged(ckpt, plan(act.specs, act.target, ckpt, act.targets))
    return ckpt


def check(specs: Sequence[LoraSpec], targets: Mapping[str, Target]) -> None:
    """Validate ``specs`` against ``targets`` (headers only): every file readable, every key
    matched, every shape fitting. Raises :class:`LoraError`."""
    names = sorted(targets)
    for spec in specs:
        if spec.target is not None and spec.target not in targets:
            raise LoraError(f"{spec}: this model has no DiT {spec.target!r}; "
                            + (f"its targets: {', '.join(names)} (or none: all)" if len(names) > 1
                               else "name no target (one DiT)"))
        names = applies_to(spec, targets)
        for t in names:
            plan([spec], targets[t], targets=[targets[n] for n in names])


def applies_to(spec: LoraSpec, targets: Mapping[str, Target]) -> list[str]:
    return sorted(targets) if spec.target is None else [spec.target]


def for_target(specs: Sequence[LoraSpec], name: str, targets: Mapping[str, Target]) -> list[LoraSpec]:
    return [s for s in specs if name in applies_to(s, targets)]
