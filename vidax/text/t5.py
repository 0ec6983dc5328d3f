"""T5 / UMT5 text encoder (encoder stack only), in float32.

One implementation covers
- T5 v1.0 (``feed_forward_proj="relu"``) and v1.1 / flan (``"gated-gelu"``): the relative attention
  bias table lives in layer 0 and is shared by every layer;
- UMT5 (Wan's text encoder): every layer owns its relative attention bias table
  (``per_layer_rel_bias=True``).

Parameters are a nested dict; the encoder blocks are stacked along a leading layer axis and run
with ``jax.lax.scan``::

    {"embed": [V, D],
     "rel_bias": [buckets, H]                  # shared variant only
     "blocks": {"ln1": [N, D], "q"/"k"/"v": {"w": [N, D, H*dk]}, "o": {"w": [N, H*dk, D]},
                "ln2": [N, D],
                "wi_0"/"wi_1": {"w": [N, D, F]} (gated) or "wi": {"w": [N, D, F]} (plain),
                "wo": {"w": [N, F, D]},
                "rel_bias": [N, buckets, H]}   # per-layer variant only
     "final_ln": [D]}

Everything is computed in float32 whatever the parameter dtype (the prompt-encoding design
rule); the caller casts the output down. Matmuls run at ``Precision.HIGHEST`` so that GPUs do not
silently drop to TF32.

Two checkpoint namings are understood: transformers' (``hf_keymap``) and the original Wan2.1
release (``wan_keymap``, ``models_t5_umt5-xxl-enc-bf16.pth``).
"""
from __future__ import annotations

import dataclasses
import json
import math
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vidax.compat import CompatModel, register
from vidax.core.attention import attention
from vidax.core.nn import ACTIVATIONS, Init, rms_norm
from vidax.weights import KeyMap, Rule, load_params, open_checkpoint

_HIGHEST = jax.lax.Precision.HIGHEST

# ---------------------------------------------------------------------------------------------
# activations: transformers' ACT2FN names that T5 configs may name (core covers the common ones)
# ---------------------------------------------------------------------------------------------
_EXTRA_ACTS = {
    "gelu_python": ACTIVATIONS["gelu"],
    "gelu_python_tanh": ACTIVATIONS["gelu_new"],
    "gelu_fast": ACTIVATIONS["gelu_new"],  # same tanh approximation as gelu_new
    "gelu_accurate": ACTIVATIONS["gelu_new"],
    "gelu_10": lambda x: jnp.clip(jax.nn.gelu(x, approximate=False), -10.0, 10.0),
    "relu6": jax.nn.relu6,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.01),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    "hardswish": jax.nn.hard_swish,
}


def _activation(name: str):
    if name in ACTIVATIONS:
        return ACTIVATIONS[name]
    if name in _EXTRA_ACTS:
        return _EXTRA_ACTS[name]
    raise ValueError(f"T5: unsupported activation {name!r}")


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
_T5_DEFAULTS = dict(
    vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
    relative_attention_num_buckets=32, relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6, feed_forward_proj="relu",
)
_UMT5_DEFAULTS = dict(
    _T5_DEFAULTS, vocab_size=250112, d_ff=1024, num_layers=8, num_heads=6, feed_forward_proj="gated-gelu",
)
_ALIASES = {"hidden_size": "d_model", "num_attention_heads": "num_heads", "num_hidden_layers": "num_layers", "head_dim": "d_kv"}


@dataclasses.dataclass(frozen=True)
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    per_layer_rel_bias: bool = False

    def __post_init__(self):
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(f"feed_forward_proj must be 'ACT' or 'gated-ACT', got {self.feed_forward_proj!r}")
        _activation(self.act_name)
        if self.relative_attention_num_buckets < 4:
            raise ValueError("relative_attention_num_buckets must be >= 4 for a bidirectional encoder")

    @property
    def is_gated(self) -> bool:
        return self.feed_forward_proj.split("-")[0] == "gated"

    @property
    def act_name(self) -> str:
        # transformers keeps "gated-gelu" meaning the tanh approximation for backwards compatibility
        if self.feed_forward_proj == "gated-gelu":
            return "gelu_new"
        return self.feed_forward_proj.split("-")[-1]

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv

    @classmethod
    def from_hf(cls, config: dict) -> "T5Config":
        """From a transformers ``T5Config`` / ``UMT5Config`` dict (``config.json`` or ``to_dict()``)."""
        c = dict(config)
        for alias, name in _ALIASES.items():
            if alias in c and name not in c:
                c[name] = c[alias]
        model_type = c.get("model_type", "")
        archs = c.get("architectures") or []
        umt5 = model_type == "umt5" or any(str(a).startswith("UMT5") for a in archs)
        if c.get("is_decoder"):
            raise ValueError("T5 config describes a decoder stack (is_decoder=True); only encoders are supported")
        base = _UMT5_DEFAULTS if umt5 else _T5_DEFAULTS
        kw = {k: (c[k] if c.get(k) is not None else v) for k, v in base.items()}
        return cls(**kw, per_layer_rel_bias=umt5)


# ---------------------------------------------------------------------------------------------
# relative position buckets (host side: the sequence length is static)
# ---------------------------------------------------------------------------------------------
def relative_position_buckets(q_len: int, k_len: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bidirectional T5 bucket index for every (query, key) pair: int32 [q_len, k_len].

    Same arithmetic as transformers (float32 log, truncation toward zero); computed with numpy so
    the table is identical on every backend."""
    rel = np.arange(k_len, dtype=np.int64)[None, :] - np.arange(q_len, dtype=np.int64)[:, None]
    half = num_buckets // 2
    bucket = np.where(rel > 0, half, 0).astype(np.int64)
    dist = np.abs(rel)
    max_exact = half // 2
    small = dist < max_exact
    d = np.maximum(dist, max_exact).astype(np.float32)  # avoid log(0); masked by `small` anyway
    scaled = (np.log(d / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
              * np.float32(half - max_exact))
    large = np.minimum(max_exact + np.trunc(scaled).astype(np.int64), half - 1)
    return (bucket + np.where(small, dist, large)).astype(np.int32)


def _position_bias(table, buckets):
    """table [buckets, H], buckets [Lq, Lk] -> additive bias [1, H, Lq, Lk] (float32)."""
    vals = jnp.take(table.astype(jnp.float32), buckets, axis=0)  # [Lq, Lk, H]
    return jnp.transpose(vals, (2, 0, 1))[None]


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def _linear(p, x):
    return jnp.matmul(x, p["w"].astype(jnp.float32), precision=_HIGHEST)


def _block(cfg: T5Config, x, blk, bias, mask):
    B, L, _ = x.shape
    h = rms_norm(x, blk["ln1"].astype(jnp.float32), eps=cfg.layer_norm_epsilon)
    q = _linear(blk["q"], h).reshape(B, L, cfg.num_heads, cfg.d_kv)
    k = _linear(blk["k"], h).reshape(B, L, cfg.num_heads, cfg.d_kv)
    v = _linear(blk["v"], h).reshape(B, L, cfg.num_heads, cfg.d_kv)
    a = attention(q, k, v, bias=bias, mask=mask, scale=1.0, impl="xla")  # T5: no 1/sqrt(d)
    x = x + _linear(blk["o"], a.reshape(B, L, cfg.inner_dim))
    h = rms_norm(x, blk["ln2"].astype(jnp.float32), eps=cfg.layer_norm_epsilon)
    act = _activation(cfg.act_name)
    if cfg.is_gated:
        f = act(_linear(blk["wi_0"], h)) * _linear(blk["wi_1"], h)
    else:
        f = act(_linear(blk["wi"], h))
    return x + _linear(blk["wo"], f)


def encode_embeds(params, cfg: T5Config, x, attention_mask=None):
    """Encoder stack on input embeddings ``x`` [B, L, D] -> last hidden state [B, L, D] float32."""
    x = jnp.asarray(x, jnp.float32)
    B, L, _ = x.shape
    mask = None
    if attention_mask is not None:
        mask = (jnp.asarray(attention_mask) != 0)[:, None, None, :]  # [B, 1, 1, Lk]: keys only
    buckets = jnp.asarray(relative_position_buckets(
        L, L, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance))
    shared_bias = None if cfg.per_layer_rel_bias else _position_bias(params["rel_bias"], buckets)

    def step(h, blk):
        bias = _position_bias(blk["rel_bias"], buckets) if cfg.per_layer_rel_bias else shared_bias
        return _block(cfg, h, blk, bias, mask), None

    x, _ = jax.lax.scan(step, x, params["blocks"])
    return rms_norm(x, params["final_ln"].astype(jnp.float32), eps=cfg.layer_norm_epsilon)


_encode_embeds_jit = jax.jit(encode_embeds, static_argnames=("cfg",))


@partial(jax.jit, static_argnames=("cfg",))
def encode(params, cfg: T5Config, input_ids, attention_mask=None):
    """Token ids [B, L] (+ mask [B, L], 1 = real token) -> last hidden state [B, L, d_model] float32.

    Padded positions are excluded as attention *keys* exactly like transformers; their own output
    rows are still computed (and match the reference)."""
    x = jnp.take(params["embed"], jnp.asarray(input_ids, jnp.int32), axis=0).astype(jnp.float32)
    return encode_embeds(params, cfg, x, attention_mask)


def param_shapes(cfg: T5Config, dtype=np.float32):
    """``jax.ShapeDtypeStruct`` tree of every parameter (used as ``like`` by the loaders)."""
    N, D, I, F = cfg.num_layers, cfg.d_model, cfg.inner_dim, cfg.d_ff
    s = lambda *shape: jax.ShapeDtypeStruct(shape, np.dtype(dtype))  # noqa: E731
    blocks = {
        "ln1": s(N, D), "q": {"w": s(N, D, I)}, "k": {"w": s(N, D, I)}, "v": {"w": s(N, D, I)},
        "o": {"w": s(N, I, D)}, "ln2": s(N, D), "wo": {"w": s(N, F, D)},
    }
    if cfg.is_gated:
        blocks["wi_0"] = {"w": s(N, D, F)}
        blocks["wi_1"] = {"w": s(N, D, F)}
    else:
        blocks["wi"] = {"w": s(N, D, F)}
    tree = {"embed": s(cfg.vocab_size, D), "blocks": blocks, "final_ln": s(D)}
    nb = cfg.relative_attention_num_buckets
    if cfg.per_layer_rel_bias:
        blocks["rel_bias"] = s(N, nb, cfg.num_heads)
    else:
        tree["rel_bias"] = s(nb, cfg.num_heads)
    return tree


def init_params(cfg: T5Config, seed: int = 0, dtype=np.float32):
    """Seeded random parameters (tiny presets, tests): nothing zero, norm weights around 1."""
    init = Init(seed, dtype)
    N, D, I, F = cfg.num_layers, cfg.d_model, cfg.inner_dim, cfg.d_ff
    lin = lambda din, dout: init.linear(din, dout, bias=False, lead=(N,))  # noqa: E731
    blocks = {
        "ln1": init.norm_weight((N, D)), "q": lin(D, I), "k": lin(D, I), "v": lin(D, I), "o": lin(I, D),
        "ln2": init.norm_weight((N, D)),
    }
    if cfg.is_gated:
        blocks["wi_0"], blocks["wi_1"] = lin(D, F), lin(D, F)
    else:
        blocks["wi"] = lin(D, F)
    blocks["wo"] = lin(F, D)
    nb = cfg.relative_attention_num_buckets
    params = {"embed": init.normal((cfg.vocab_size, D), std=1.0), "blocks": blocks,
              "final_ln": init.norm_weight((D,))}
    if cfg.per_layer_rel_bias:
        blocks["rel_bias"] = init.normal((N, nb, cfg.num_heads), std=0.5)
    else:
        params["rel_bias"] = init.normal((nb, cfg.num_heads), std=0.5)
    return params


# ---------------------------------------------------------------------------------------------
# key maps
# ---------------------------------------------------------------------------------------------
HF_EMBED_NAMES = ("shared.weight", "encoder.embed_tokens.weight")


def hf_keymap(cfg: T5Config, embed_name: str = "shared.weight") -> KeyMap:
    """transformers naming (``T5EncoderModel`` / ``UMT5EncoderModel``, or the encoder half of a
    full ``T5ForConditionalGeneration`` checkpoint: decoder / lm_head tensors are ignored).

    The token embedding is tied under two names; ``embed_name`` picks the one read, the other is
    ignored (``save_pretrained`` of an encoder model writes only ``shared.weight``)."""
    if embed_name not in HF_EMBED_NAMES:
        raise ValueError(f"embed_name must be one of {HF_EMBED_NAMES}")
    b = "encoder.block.{i}.layer"
    rules = [
        Rule(embed_name, "embed"),
        Rule(f"{b}.0.layer_norm.weight", "blocks.ln1"),
        Rule(f"{b}.0.SelfAttention.q.weight", "blocks.q.w", "linear"),
        Rule(f"{b}.0.SelfAttention.k.weight", "blocks.k.w", "linear"),
        Rule(f"{b}.0.SelfAttention.v.weight", "blocks.v.w", "linear"),
        Rule(f"{b}.0.SelfAttention.o.weight", "blocks.o.w", "linear"),
        Rule(f"{b}.1.layer_norm.weight", "blocks.ln2"),
        Rule(f"{b}.1.DenseReluDense.wo.weight", "blocks.wo.w", "linear"),
        Rule("encoder.final_layer_norm.weight", "final_ln"),
    ]
    if cfg.is_gated:
        rules += [Rule(f"{b}.1.DenseReluDense.wi_0.weight", "blocks.wi_0.w", "linear"),
                  Rule(f"{b}.1.DenseReluDense.wi_1.weight", "blocks.wi_1.w", "linear")]
    else:
        rules.append(Rule(f"{b}.1.DenseReluDense.wi.weight", "blocks.wi.w", "linear"))
    if cfg.per_layer_rel_bias:
        rules.append(Rule(f"{b}.0.SelfAttention.relative_attention_bias.weight", "blocks.rel_bias"))
    else:
        rules.append(Rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "rel_bias"))
    other = [n for n in HF_EMBED_NAMES if n != embed_name]
    ignore = ["^" + n.replace(".", r"\.") + "$" for n in other] + [r"^decoder\.", r"^lm_head\."]
    return KeyMap(rules, ignore=ignore)


def wan_keymap(cfg: T5Config) -> KeyMap:
    """Original Wan2.1 naming (``wan/modules/t5.py``: ``T5Encoder`` state dict, as in
    ``models_t5_umt5-xxl-enc-bf16.pth``). Wan's feed-forward is ``fc2(fc1(x) * gelu(gate(x)))``:
    ``gate.0`` is the activated branch (transformers' ``wi_0``), ``fc1`` the linear one (``wi_1``)."""
    if not cfg.is_gated:
        raise ValueError("the Wan T5 naming only exists for the gated feed-forward")
    b = "blocks.{i}"
    rules = [
        Rule("token_embedding.weight", "embed"),
        Rule(f"{b}.norm1.weight", "blocks.ln1"),
        Rule(f"{b}.attn.q.weight", "blocks.q.w", "linear"),
        Rule(f"{b}.attn.k.weight", "blocks.k.w", "linear"),
        Rule(f"{b}.attn.v.weight", "blocks.v.w", "linear"),
        Rule(f"{b}.attn.o.weight", "blocks.o.w", "linear"),
        Rule(f"{b}.norm2.weight", "blocks.ln2"),
        Rule(f"{b}.ffn.gate.0.weight", "blocks.wi_0.w", "linear"),
        Rule(f"{b}.ffn.fc1.weight", "blocks.wi_1.w", "linear"),
        Rule(f"{b}.ffn.fc2.weight", "blocks.wo.w", "linear"),
        Rule("norm.weight", "final_ln"),
    ]
    if cfg.per_layer_rel_bias:
        rules.append(Rule(f"{b}.pos_embedding.embedding.weight", "blocks.rel_bias"))
    else:
        rules.append(Rule("pos_embedding.embedding.weight", "rel_bias"))
    return KeyMap(rules)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def detect_naming(names) -> str:
    names = set(names)
    if "token_embedding.weight" in names or any(n.startswith("blocks.0.") for n in names):
        return "wan"
    if any(n in names for n in HF_EMBED_NAMES) or any(n.startswith("encoder.block.") for n in names):
        return "hf"
    raise ValueError("checkpoint is neither transformers-T5- nor Wan-T5-named "
                     f"(first names: {sorted(names)[:5]})")


def _num_layers(names, pattern: str) -> int:
    import re

    pat = re.compile(pattern)
    idx = [int(m.group(1)) for n in names if (m := pat.match(n))]
    return max(idx) + 1 if idx else 0


def infer_config(ckpt) -> T5Config:
    """Infer the architecture from tensor names and shapes (for config-less files).

    Exact for Wan's checkpoints (their code fixes gated tanh-GELU, eps 1e-6, max distance 128);
    for transformers-named files without a config the T5 defaults fill in the activation
    (gated -> ``gated-gelu``, plain -> ``relu``), eps and max distance."""
    names = list(ckpt)
    shape = lambda n: tuple(ckpt[n].shape)  # noqa: E731
    if detect_naming(names) == "wan":
        V, D = shape("token_embedding.weight")
        per_layer = "blocks.0.pos_embedding.embedding.weight" in ckpt
        nb, H = shape("blocks.0.pos_embedding.embedding.weight" if per_layer else "pos_embedding.embedding.weight")
        inner = shape("blocks.0.attn.q.weight")[0]
        F = shape("blocks.0.ffn.fc1.weight")[0]
        N = _num_layers(names, r"^blocks\.(\d+)\.")
        return T5Config(vocab_size=V, d_model=D, d_kv=inner // H, d_ff=F, num_layers=N, num_heads=H,
                        relative_attention_num_buckets=nb, relative_attention_max_distance=128,
                        layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", per_layer_rel_bias=per_layer)
    emb = next(n for n in HF_EMBED_NAMES if n in ckpt)
    V, D = shape(emb)
    rb = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
    nb, H = shape(rb.format(0))
    per_layer = rb.format(1) in ckpt
    inner = shape("encoder.block.0.layer.0.SelfAttention.q.weight")[0]
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in ckpt
    F = shape("encoder.block.0.layer.1.DenseReluDense.wo.weight")[1]
    N = _num_layers(names, r"^encoder\.block\.(\d+)\.")
    return T5Config(vocab_size=V, d_model=D, d_kv=inner // H, d_ff=F, num_layers=N, num_heads=H,
                    relative_attention_num_buckets=nb, feed_forward_proj="gated-gelu" if gated else "relu",
                    per_layer_rel_bias=per_layer)


def load_params_from(ckpt, cfg: T5Config, dtype=np.float32, naming: str | None = None):
    """Read a checkpoint (an opened ``Checkpoint`` or a name -> array mapping) into vidax params."""
    naming = naming or detect_naming(list(ckpt))
    if naming == "wan":
        km = wan_keymap(cfg)
    elif naming == "hf":
        embed = next((n for n in HF_EMBED_NAMES if n in ckpt), "shared.weight")
        km = hf_keymap(cfg, embed_name=embed)
    else:
        raise ValueError(f"unknown naming {naming!r}")
    return load_params(ckpt, km, param_shapes(cfg, dtype), dtype=dtype, what=f"T5 encoder ({naming} naming)")


class T5Encoder(NamedTuple):
    """Loaded encoder: ``params`` + ``cfg``; call it with ``(input_ids, attention_mask)``."""

    params: dict
    cfg: T5Config

    def __call__(self, input_ids, attention_mask=None):
        return encode(self.params, self.cfg, input_ids, attention_mask)


def load_t5(path, cfg: T5Config | None = None, dtype=np.float32, device_put: bool = True) -> T5Encoder:
    """Load a T5/UMT5 encoder from a transformers folder (``config.json`` + safetensors) or a single
    checkpoint file (e.g. Wan's original ``models_t5_umt5-xxl-enc-bf16.pth``); the naming is detected
    from the tensor names. ``dtype``: storage dtype of the parameters (compute is float32)."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists() and (p / "text_encoder" / "config.json").exists():
        p = p / "text_encoder"  # diffusers pipeline folder
    if p.is_dir() and cfg is None and (p / "config.json").exists():
        cfg = T5Config.from_hf(json.loads((p / "config.json").read_text()))
    ckpt = open_checkpoint(p)
    if cfg is None:
        cfg = infer_config(ckpt)
    params = load_params_from(ckpt, cfg, dtype=dtype)
    if device_put:
        params = jax.device_put(params)
    return T5Encoder(params, cfg)


# ---------------------------------------------------------------------------------------------
# compat adapter (transformers calling convention)
# ---------------------------------------------------------------------------------------------
class _T5Compat(CompatModel):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs) -> np.ndarray:
        for k, v in kwargs.items():
            if v is not None and k not in ("return_dict", "output_hidden_states", "output_attentions"):
                raise TypeError(f"{self.name}.forward: unsupported argument {k!r}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids / inputs_embeds")
        mask = None if attention_mask is None else np.asarray(attention_mask)
        if input_ids is not None:
            out = encode(self.params, self.model_config, np.asarray(input_ids), mask)
        else:
            out = _encode_embeds_jit(self.params, self.model_config, np.asarray(inputs_embeds, np.float32), mask)
        return np.asarray(out)


@register("T5EncoderModel", "UMT5EncoderModel")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **kw) -> CompatModel:
    cfg = T5Config.from_hf(config)
    params = load_params_from(open_checkpoint(folder), cfg, dtype=dtype, naming="hf")
    params = jax.device_put(params)
    name = (config.get("architectures") or ["T5EncoderModel"])[0]
    return _T5Compat(name, config, params, model_config=cfg)


__all__ = [
    "T5Config", "T5Encoder", "encode", "encode_embeds", "init_params", "param_shapes",
    "relative_position_buckets", "hf_keymap", "wan_keymap", "detect_naming", "infer_config",
    "load_params_from", "load_t5",
]
