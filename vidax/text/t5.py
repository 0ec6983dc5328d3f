"""T5 / UMT5 text encoder (encoder stack only), in float32.

One implementation covers
- T5 v1.0 (``feed_forward_proj="relu"``) and v1.1 / flan (``"gated-gelu"``): the relative attention
  bias table lives in layer 0 and is shared by every layer;
- UMT5 (Wan's text encoder): every layer owns its relative attention bias table
  (``per_layer_rel_bias=True``).

The model is a Flax NNX module (:class:`T5`); its blocks are stacked along a leading layer axis
(``nn.stack``) and run with a scan. The state, as ``nnx.to_pure_dict`` nests it::

    {"embed": {"embedding": [V, D]},
     "rel_bias": {"embedding": [buckets, H]},            # shared variant only
     "blocks": {"norm1"/"norm2": {"scale": [N, D]},
                "q"/"k"/"v": {"kernel": [N, D, H*dk]}, "o": {"kernel": [N, H*dk, D]},
                "wi_0"/"wi_1": {"kernel": [N, D, F]} (gated) or "wi": {"kernel": [N, D, F]} (plain),
                "wo": {"kernel": [N, F, D]},
                "rel_bias": {"embedding": [N, buckets, H]}},  # per-layer variant only
     "final_norm": {"scale": [D]}}

Parameters carry logical axis names (``vocab``, ``embed``, ``heads``, ``ffn``; ``layers`` on the
stack) for the sharding rules. A loaded encoder is a :class:`T5Encoder`: the module split once,
called through one jitted pure function of its state.

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax.compat import CompatModel, register
from vidax.core import nn
from vidax.core.attention import attention
from vidax.core.nn import ACTIVATIONS
from vidax.weights import KeyMap, Rule, load_params, open_checkpoint

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


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
def _rel_bias_table(cfg: T5Config, rngs: nnx.Rngs, param_dtype) -> nnx.Embed:
    """The relative attention bias: one learned scalar per (bucket, head)."""
    return nn.Embed(cfg.relative_attention_num_buckets, cfg.num_heads, rngs=rngs, axes=(None, "heads"),
                    std=cfg.d_model**-0.5, param_dtype=param_dtype)


def _position_bias(table: nnx.Embed, buckets) -> jax.Array:
    """Bucket table, buckets [Lq, Lk] -> additive attention bias [1, H, Lq, Lk] (float32)."""
    return jnp.transpose(table(buckets).astype(jnp.float32), (2, 0, 1))[None]


class T5Block(nnx.Module):
    """One encoder layer: RMS-normed self-attention (no 1/sqrt(d) scale, additive relative position
    bias), then the RMS-normed (gated) feed-forward, both residual."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        D, I, F = cfg.d_model, cfg.inner_dim, cfg.d_ff
        lin = partial(nn.Linear, rngs=rngs, bias=False, param_dtype=param_dtype, precision=jax.lax.Precision.HIGHEST)
        norm = partial(nn.RMSNorm, D, rngs=rngs, eps=cfg.layer_norm_epsilon, axis="embed", param_dtype=param_dtype)
        self.norm1 = norm()
        self.q, self.k, self.v = (lin(D, I, axes=("embed", "heads")) for _ in range(3))
        self.o = lin(I, D, axes=("heads", "embed"))
        self.norm2 = norm()
        if cfg.is_gated:
            self.wi_0, self.wi_1 = (lin(D, F, axes=("embed", "ffn")) for _ in range(2))
        else:
            self.wi = lin(D, F, axes=("embed", "ffn"))
        self.wo = lin(F, D, axes=("ffn", "embed"))
        # UMT5: every layer owns its bucket table; T5: the encoder's shared one is passed in
        self.rel_bias = _rel_bias_table(cfg, rngs, param_dtype) if cfg.per_layer_rel_bias else None

    def __call__(self, x, bias, mask):
        """``x`` [B, L, D] float32, ``bias`` [1, H, L, L], ``mask`` [B, 1, 1, L] bool or None."""
        cfg = self.cfg
        B, L, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).reshape(B, L, cfg.num_heads, cfg.d_kv) for p in (self.q, self.k, self.v))
        a = attention(q, k, v, bias=bias, mask=mask, scale=1.0, impl="xla")
        x = x + self.o(a.reshape(B, L, cfg.inner_dim))
        h = self.norm2(x)
        act = _activation(cfg.act_name)
        f = act(self.wi_0(h)) * self.wi_1(h) if cfg.is_gated else act(self.wi(h))
        return x + self.wo(f)


class T5(nnx.Module):
    """T5 / UMT5 encoder stack: token embedding, ``num_layers`` stacked :class:`T5Block` run by a
    scan, final RMS norm. Computes in float32 whatever the parameters' dtype (each layer's weights
    are upcast as it runs; the embedding rows after the gather)."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs, axes=("vocab", "embed"), param_dtype=param_dtype)
        self.rel_bias = None if cfg.per_layer_rel_bias else _rel_bias_table(cfg, rngs, param_dtype)
        self.blocks = nn.stack(lambda r: T5Block(cfg, rngs=r, param_dtype=param_dtype), cfg.num_layers, rngs)
        self.final_norm = nn.RMSNorm(cfg.d_model, rngs=rngs, eps=cfg.layer_norm_epsilon, axis="embed",
                                     param_dtype=param_dtype)

    def __call__(self, input_ids, attention_mask=None):
        """Token ids [B, L] (+ mask [B, L], 1 = real token) -> last hidden state [B, L, d_model] float32.

        Padded positions are excluded as attention *keys* exactly like transformers; their own
        output rows are still computed (and match the reference)."""
        x = self.embed(jnp.asarray(input_ids, jnp.int32)).astype(jnp.float32)
        return self.encode_embeds(x, attention_mask)

    def encode_embeds(self, inputs_embeds, attention_mask=None):
        """The stack on input embeddings [B, L, D] -> last hidden state [B, L, D] float32."""
        x = jnp.asarray(inputs_embeds, jnp.float32)
        return self.final_norm(nn.scan(self.blocks, x, self._layer_fn(x.shape[1], attention_mask)))

    def hidden_states(self, input_ids, attention_mask=None):
        """All hidden states [num_layers + 1, B, L, D] float32: the reference's
        ``output_hidden_states`` tuple stacked (0: embeddings, i: output of layer i, last: the
        final-normed output = ``last_hidden_state``)."""
        return self.hidden_states_embeds(self.embed(jnp.asarray(input_ids, jnp.int32)).astype(jnp.float32), attention_mask)

    def hidden_states_embeds(self, inputs_embeds, attention_mask=None):
        x = jnp.asarray(inputs_embeds, jnp.float32)
        last, hs = nn.scan_range(self.blocks, x, self._layer_fn(x.shape[1], attention_mask), collect=True)
        return jnp.concatenate([x[None], hs[:-1], self.final_norm(last)[None]], axis=0)

    def _layer_fn(self, L: int, attention_mask):
        cfg = self.cfg
        mask = None if attention_mask is None else (jnp.asarray(attention_mask) != 0)[:, None, None, :]  # keys only
        buckets = jnp.asarray(relative_position_buckets(
            L, L, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance))
        shared = None if self.rel_bias is None else _position_bias(self.rel_bias, buckets)

        def layer(block: T5Block, h):
            bias = shared if shared is not None else _position_bias(block.rel_bias, buckets)
            return block(h, bias, mask)

        return layer


class T5Encoder(nn.Split):
    """A T5 / UMT5 encoder split once (``graphdef``, ``state``, ``cfg``); its calls are one jitted
    pure function of the state. ``enc(input_ids, attention_mask)`` -> last hidden state
    [B, L, d_model] float32 (:meth:`T5.__call__`)."""

    def __call__(self, input_ids, attention_mask=None):
        return self.apply("__call__", input_ids, attention_mask)

    def encode_embeds(self, inputs_embeds, attention_mask=None):
        """:meth:`T5.encode_embeds`: the stack on input embeddings [B, L, D]."""
        return self.apply("encode_embeds", inputs_embeds, attention_mask)

    def hidden_states(self, input_ids, attention_mask=None):
        """:meth:`T5.hidden_states`: every layer's output [num_layers + 1, B, L, D]."""
        return self.apply("hidden_states", input_ids, attention_mask)

    def hidden_states_embeds(self, inputs_embeds, attention_mask=None):
        return self.apply("hidden_states_embeds", inputs_embeds, attention_mask)


def _build(cfg: T5Config, seed: int = 0, dtype=np.float32):
    return lambda: T5(cfg, rngs=nnx.Rngs(seed), param_dtype=dtype)


def init(cfg: T5Config, seed: int = 0, dtype=np.float32) -> T5Encoder:
    """Seeded random weights (tiny presets, tests): every parameter perturbed (nothing zero, norm
    scales around 1)."""
    return T5Encoder.of(nn.perturb(_build(cfg, seed, dtype)(), seed))


def param_shapes(cfg: T5Config, dtype=np.float32) -> dict:
    """Every parameter as a ``jax.ShapeDtypeStruct``, nested like the NNX state (the key maps' target)."""
    return nn.shapes(_build(cfg, dtype=dtype))


def abstract(cfg: T5Config, dtype=np.float32) -> T5Encoder:
    """An encoder whose state holds only ``jax.ShapeDtypeStruct`` s (shape checks with
    ``jax.eval_shape``; nothing allocated)."""
    return T5Encoder(*nn.abstract_state(_build(cfg, dtype=dtype)), cfg)


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
        Rule(embed_name, "embed.embedding"),
        Rule(f"{b}.0.layer_norm.weight", "blocks.norm1.scale"),
        Rule(f"{b}.0.SelfAttention.q.weight", "blocks.q.kernel", "linear"),
        Rule(f"{b}.0.SelfAttention.k.weight", "blocks.k.kernel", "linear"),
        Rule(f"{b}.0.SelfAttention.v.weight", "blocks.v.kernel", "linear"),
        Rule(f"{b}.0.SelfAttention.o.weight", "blocks.o.kernel", "linear"),
        Rule(f"{b}.1.layer_norm.weight", "blocks.norm2.scale"),
        Rule(f"{b}.1.DenseReluDense.wo.weight", "blocks.wo.kernel", "linear"),
        Rule("encoder.final_layer_norm.weight", "final_norm.scale"),
    ]
    if cfg.is_gated:
        rules += [Rule(f"{b}.1.DenseReluDense.wi_0.weight", "blocks.wi_0.kernel", "linear"),
                  Rule(f"{b}.1.DenseReluDense.wi_1.weight", "blocks.wi_1.kernel", "linear")]
    else:
        rules.append(Rule(f"{b}.1.DenseReluDense.wi.weight", "blocks.wi.kernel", "linear"))
    if cfg.per_layer_rel_bias:
        rules.append(Rule(f"{b}.0.SelfAttention.relative_attention_bias.weight", "blocks.rel_bias.embedding"))
    else:
        rules.append(Rule("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "rel_bias.embedding"))
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
        Rule("token_embedding.weight", "embed.embedding"),
        Rule(f"{b}.norm1.weight", "blocks.norm1.scale"),
        Rule(f"{b}.attn.q.weight", "blocks.q.kernel", "linear"),
        Rule(f"{b}.attn.k.weight", "blocks.k.kernel", "linear"),
        Rule(f"{b}.attn.v.weight", "blocks.v.kernel", "linear"),
        Rule(f"{b}.attn.o.weight", "blocks.o.kernel", "linear"),
        Rule(f"{b}.norm2.weight", "blocks.norm2.scale"),
        Rule(f"{b}.ffn.gate.0.weight", "blocks.wi_0.kernel", "linear"),
        Rule(f"{b}.ffn.fc1.weight", "blocks.wi_1.kernel", "linear"),
        Rule(f"{b}.ffn.fc2.weight", "blocks.wo.kernel", "linear"),
        Rule("norm.weight", "final_norm.scale"),
    ]
    if cfg.per_layer_rel_bias:
        rules.append(Rule(f"{b}.pos_embedding.embedding.weight", "blocks.rel_bias.embedding"))
    else:
        rules.append(Rule("pos_embedding.embedding.weight", "rel_bias.embedding"))
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


def load_params_from(ckpt, cfg: T5Config, dtype=np.float32, naming: str | None = None) -> dict:
    """Read a checkpoint (an opened ``Checkpoint`` or a name -> array mapping) into the encoder's
    state as a nested dict of host numpy arrays (``nnx.to_pure_dict`` layout), cast to ``dtype``."""
    naming = naming or detect_naming(list(ckpt))
    if naming == "wan":
        km = wan_keymap(cfg)
    elif naming == "hf":
        embed = next((n for n in HF_EMBED_NAMES if n in ckpt), "shared.weight")
        km = hf_keymap(cfg, embed_name=embed)
    else:
        raise ValueError(f"unknown naming {naming!r}")
    return load_params(ckpt, km, param_shapes(cfg, dtype), dtype=dtype, what=f"T5 encoder ({naming} naming)")


def from_params(cfg: T5Config, params: dict, device_put: bool = True) -> T5Encoder:
    """An encoder whose state is ``params`` (:func:`load_params_from`'s nested dict); no random
    weights are created."""
    return T5Encoder.from_pure(_build(cfg), params, device_put=device_put)


def tp_rules(cfg: T5Config, tp: int) -> dict[str, str]:
    """Megatron tensor parallelism over a ``tp``-way axis: attention heads (q/k/v columns, the
    output projection's rows, the relative-position bias), the FFN and the vocabulary, each where
    ``tp`` divides it (else replicated)."""
    from vidax.core.sharding import axis_rules

    return axis_rules("tp", {"vocab": "tp"}, dims=dict(heads=cfg.num_heads, ffn=cfg.d_ff, vocab=cfg.vocab_size),
                      sizes={"tp": tp})


def shard(enc: T5Encoder, mesh) -> T5Encoder:
    """``enc`` split over ``mesh``'s ``tp`` axis (a Mesh or ``"tp=8"``) by :func:`tp_rules`: UMT5-XXL
    in float32 (21 GiB) is 2.7 GiB per device on 8; the encode stays float32 throughout."""
    from vidax.core import mesh as vmesh
    from vidax.core.sharding import shard_split

    mesh = vmesh.make_mesh(mesh)
    return shard_split(enc, tp_rules(enc.cfg, vmesh.axis_sizes(mesh)["tp"]), mesh)


def plan_unit(cfg: T5Config, batch: int, length: int, *, dtype=np.float32, tp: int = 1, mask: bool = True,
              name: str = "T5 text encoder"):
    """The encode stage's program at abstract shapes (``vidax plan``): ``batch`` prompts of
    ``length`` tokens, the weights stored as ``dtype`` and split ``tp`` ways as :func:`shard` does."""
    from vidax.core import plan as vplan

    enc = abstract(cfg, dtype)
    enc = shard(enc, f"tp={tp}") if tp > 1 else enc
    ids = vplan.abstract((batch, length), np.int32)
    return vplan.split_unit("encode", name, enc, ids, ids if mask else None,
                            note=f"{batch} prompt(s) x {length} tokens" + (f", tp={tp}" if tp > 1 else ""))


def load_t5(path, cfg: T5Config | None = None, dtype=np.float32, device_put: bool = True, mesh=None) -> T5Encoder:
    """Load a T5/UMT5 encoder from a transformers folder (``config.json`` + safetensors) or a single
    checkpoint file (e.g. Wan's original ``models_t5_umt5-xxl-enc-bf16.pth``); the naming is detected
    from the tensor names. ``dtype``: storage dtype of the parameters (compute is float32). ``mesh``:
    split it over the mesh's ``tp`` axis (:func:`shard`; each device reads only its slices)."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists() and (p / "text_encoder" / "config.json").exists():
        p = p / "text_encoder"  # diffusers pipeline folder
    if p.is_dir() and cfg is None and (p / "config.json").exists():
        cfg = T5Config.from_hf(json.loads((p / "config.json").read_text()))
    ckpt = open_checkpoint(p)
    if cfg is None:
        cfg = infer_config(ckpt)
    params = load_params_from(ckpt, cfg, dtype=dtype)
    if mesh is not None:
        return shard(from_params(cfg, params, device_put=False), mesh)
    return from_params(cfg, params, device_put=device_put)


# ---------------------------------------------------------------------------------------------
# compat adapter (transformers calling convention)
# ---------------------------------------------------------------------------------------------
class _T5Compat(CompatModel):
    def __init__(self, name: str, config: dict, encoder: T5Encoder):
        super().__init__(name, config, encoder.state, model_config=encoder.cfg)
        self.encoder = encoder

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs) -> np.ndarray:
        for k, v in kwargs.items():
            if v is not None and k not in ("return_dict", "output_hidden_states", "output_attentions"):
                raise TypeError(f"{self.name}.forward: unsupported argument {k!r}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids / inputs_embeds")
        mask = None if attention_mask is None else np.asarray(attention_mask)
        if input_ids is not None:
            out = self.encoder(np.asarray(input_ids), mask)
        else:
            out = self.encoder.encode_embeds(np.asarray(inputs_embeds, np.float32), mask)
        return np.asarray(out)

    def outputs(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_hidden_states=False, **kwargs):
        """The reference's ``BaseModelOutput`` fields (dict with attribute access): ``last_hidden_state``
        and, with ``output_hidden_states``, the ``hidden_states`` tuple."""
        from vidax.text.lm import Output

        if not output_hidden_states:
            return Output(last_hidden_state=self.forward(input_ids, attention_mask, inputs_embeds, **kwargs))
        for k, v in kwargs.items():
            if v is not None and k not in ("return_dict", "output_attentions"):
                raise TypeError(f"{self.name}.forward: unsupported argument {k!r}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids / inputs_embeds")
        mask = None if attention_mask is None else np.asarray(attention_mask)
        if input_ids is not None:
            hs = np.asarray(self.encoder.hidden_states(np.asarray(input_ids), mask))
        else:
            hs = np.asarray(self.encoder.hidden_states_embeds(np.asarray(inputs_embeds, np.float32), mask))
        return Output(last_hidden_state=hs[-1], hidden_states=tuple(hs))

    __call__ = outputs


@register("T5EncoderModel", "UMT5EncoderModel")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **kw) -> CompatModel:
    cfg = T5Config.from_hf(config)
    enc = from_params(cfg, load_params_from(open_checkpoint(folder), cfg, dtype=dtype, naming="hf"))
    name = (config.get("architectures") or ["T5EncoderModel"])[0]
    return _T5Compat(name, config, enc)


__all__ = [
    "T5Config", "T5", "T5Block", "T5Encoder", "init", "abstract", "param_shapes", "relative_position_buckets", "hf_keymap",
    "wan_keymap", "detect_naming", "infer_config", "load_params_from", "from_params", "load_t5",
]
