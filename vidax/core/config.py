"""Model configs from reference ``config.json`` files: the keyword arguments of a dataclass config."""
from __future__ import annotations

from dataclasses import dataclass, fields

#: diffusers' attention-size names -> the DiT configs' field names
HEAD_NAMES = {"num_attention_heads": "num_heads", "attention_head_dim": "head_dim"}


class Heads:
    """A DiT config's derived widths (a mixin of a dataclass with ``num_heads`` / ``head_dim``):
    ``dim`` = heads x head size, ``mlp_dim`` = ``dim`` x ``mlp_ratio`` (where the config has one)."""

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def mlp_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)


@dataclass(frozen=True)
class DiTConfig(Heads):
    """The fields every one-video-stream DiT config has (diffusers' names after :data:`HEAD_NAMES`).
    A family's config subclasses it (or a family base that does), gives its release's values of the
    inherited fields in the class statement and lists only its own fields::

        @dataclass(frozen=True)
        class WanDiTConfig(DiTConfig, num_heads=40, head_dim=128, num_layers=40):
            text_dim: int = 4096"""

    in_channels: int = 16
    out_channels: int = 16
    num_heads: int = 16
    head_dim: int = 128
    num_layers: int = 1

    def __init_subclass__(cls, **defaults):
        super().__init_subclass__()
        own = cls.__dict__.get("__annotations__", {})
        types = {f.name: f.type for base in cls.__mro__[:0:-1] for f in getattr(base, "__dataclass_fields__", {}).values()}
        for name, value in defaults.items():
            if name not in types:
                raise TypeError(f"{cls.__name__}: {name!r} is not a field of its base config ({', '.join(types)})")
            own[name] = types[name]
            setattr(cls, name, value)
        cls.__annotations__ = own


def diffusers_kwargs(cls, cfg: dict, rename: dict = HEAD_NAMES, defaults=(("out_channels", "in_channels"),)) -> dict:
    """The fields of dataclass ``cls`` found in ``cfg`` (after ``rename``), lists as tuples (configs
    are hashable); each ``(field, source)`` of ``defaults`` left None takes ``source``'s value."""
    names = {f.name for f in fields(cls)}
    kw = {rename.get(k, k): (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if rename.get(k, k) in names}
    for name, source in defaults:
        if kw.get(name) is None:
            kw[name] = kw.get(source, getattr(cls, source))
    return kw
