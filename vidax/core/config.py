"""Model configs from reference ``config.json`` files: the keyword arguments of a dataclass config."""
from __future__ import annotations

from dataclasses import fields

#: diffusers' attention-size names -> the DiT configs' field names
HEAD_NAMES = {"num_attention_heads": "num_heads", "attention_head_dim": "head_dim"}


def diffusers_kwargs(cls, cfg: dict, rename: dict = HEAD_NAMES, defaults=(("out_channels", "in_channels"),)) -> dict:
    """The fields of dataclass ``cls`` found in ``cfg`` (after ``rename``), lists as tuples (configs
    are hashable); each ``(field, source)`` of ``defaults`` left None takes ``source``'s value."""
    names = {f.name for f in fields(cls)}
    kw = {rename.get(k, k): (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if rename.get(k, k) in names}
    for name, source in defaults:
        if kw.get(name) is None:
            kw[name] = kw.get(source, getattr(cls, source))
    return kw
