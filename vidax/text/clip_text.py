"""CLIP text tower (transformers ``CLIPTextModel`` / ``CLIPTextModelWithProjection``), in float32.

HunyuanVideo 1.0 feeds CLIP ViT-L/14's **pooled** text output (the final-normed hidden state at
the end-of-text token) into its modulation. The model is a Flax NNX module (:class:`CLIPText`):
token + learned position embeddings, ``num_layers`` stacked pre-LN causal encoder layers
(:class:`vidax.text.encoder.EncoderBlock`) run by a scan, final LayerNorm, the text projection
(``WithProjection``). State::

    {"token": {"embedding": [V, D]}, "pos": {"embedding": [P, D]},
     "blocks": {...EncoderBlock stack...}, "final_norm": {"scale": [D], "bias": [D]},
     "proj": {"kernel": [D, projection_dim]}}      # WithProjection only

Masks as the reference: causal, and ``attention_mask`` on the keys. The pooled token is the
reference's: configs with the legacy ``eos_token_id == 2`` take the position of the largest id
(the end-of-text token is the largest id of the original vocabulary); others the first position
holding ``eos_token_id``.

Checkpoint namings: ``text_model.*`` (hub checkpoints, ``WithProjection``, a full ``CLIPModel``
whose vision half is ignored) or no prefix (transformers 5 ``CLIPTextModel.save_pretrained``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax.compat import CompatModel, register
from vidax.core import nn
from vidax.text import encoder
from vidax.text.lm import Output, check_kwargs
from vidax.weights import KeyMap, Rule, load_params, open_checkpoint

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST

_HF_DEFAULTS = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, projection_dim=512, num_hidden_layers=12,
                    num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                    eos_token_id=49407)


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig:
    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_layers: int = 12
    num_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407
    projection_dim: int | None = None  # set: CLIPTextModelWithProjection (text_embeds)

    @classmethod
    def from_hf(cls, config: dict, with_projection: bool | None = None) -> "CLIPTextConfig":
        """From a ``CLIPTextConfig`` dict, or a ``CLIPConfig`` dict (its ``text_config``)."""
        archs = [str(a) for a in (config.get("architectures") or [])]
        c = dict(config.get("text_config") or {}) if "text_config" in config else dict(config)
        if with_projection is None:
            with_projection = any(a in ("CLIPTextModelWithProjection", "CLIPModel") for a in archs)
        if "text_config" in config and config.get("projection_dim") is not None:
            c["projection_dim"] = config["projection_dim"]
        k = {n: (c[n] if c.get(n) is not None else v) for n, v in _HF_DEFAULTS.items()}
        return cls(vocab_size=k["vocab_size"], hidden_size=k["hidden_size"], intermediate_size=k["intermediate_size"],
                   num_layers=k["num_hidden_layers"], num_heads=k["num_attention_heads"],
                   max_position_embeddings=k["max_position_embeddings"], hidden_act=k["hidden_act"],
                   layer_norm_eps=float(k["layer_norm_eps"]), eos_token_id=int(k["eos_token_id"]),
                   projection_dim=k["projection_dim"] if with_projection else None)


class CLIPText(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        D = cfg.hidden_size
        self.token = nn.Embed(cfg.vocab_size, D, rngs=rngs, axes=("vocab", "embed"), std=0.02, param_dtype=param_dtype)
        self.pos = nn.Embed(cfg.max_position_embeddings, D, rngs=rngs, axes=(None, "embed"), std=0.02,
                            param_dtype=param_dtype)
        self.blocks = nn.stack(lambda r: encoder.EncoderBlock(D, cfg.intermediate_size, cfg.num_heads,
                                                              act=cfg.hidden_act, eps=cfg.layer_norm_eps, rngs=r,
                                                              param_dtype=param_dtype), cfg.num_layers, rngs)
        self.final_norm = nn.LayerNorm(D, rngs=rngs, eps=cfg.layer_norm_eps, axis="embed", param_dtype=param_dtype)
        self.proj = None if cfg.projection_dim is None else nn.Linear(
            D, cfg.projection_dim, rngs=rngs, axes=("embed", None), bias=False, param_dtype=param_dtype, precision=_HI)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states: bool = False) -> dict:
        """ids [B, T] (T <= max_position_embeddings) -> dict of float32 arrays: ``last_hidden_state``
        [B, T, D] (final norm applied), ``pooler_output`` [B, D], ``text_embeds`` [B, P]
        (projection models), ``hidden_states`` [L+1, B, T, D] (with ``output_hidden_states``: the
        reference's tuple, entry L un-normed)."""
        cfg = self.cfg
        ids = jnp.asarray(input_ids, jnp.int32)
        B, T = ids.shape
        if T > cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_position_embeddings {cfg.max_position_embeddings}")
        pos = jnp.arange(T, dtype=jnp.int32)[None] if position_ids is None else jnp.asarray(position_ids, jnp.int32)
        x0 = self.token(ids).astype(_F32) + self.pos(pos).astype(_F32)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        if attention_mask is not None:
            mask = mask & (jnp.asarray(attention_mask) != 0)[:, None, :]
        x, hs = encoder.run(self.blocks, x0, mask, collect=output_hidden_states)
        last = self.final_norm(x)
        eos = jnp.argmax(ids, axis=-1) if cfg.eos_token_id == 2 else jnp.argmax((ids == cfg.eos_token_id).astype(jnp.int32), -1)
        pooled = last[jnp.arange(B), eos]
        out = {"last_hidden_state": last, "pooler_output": pooled}
        if self.proj is not None:
            out["text_embeds"] = self.proj(pooled)
        if output_hidden_states:
            out["hidden_states"] = jnp.concatenate([x0[None], hs], axis=0)
        return out


class CLIPTextEncoder(nn.Split):
    """A CLIP text tower split once; ``enc(input_ids, attention_mask=None, position_ids=None,
    output_hidden_states=False)`` -> :meth:`CLIPText.__call__`'s dict (one jitted function)."""

    def __call__(self, input_ids, attention_mask=None, position_ids=None, output_hidden_states: bool = False) -> dict:
        return self.apply("__call__", input_ids, attention_mask, position_ids,
                          output_hidden_states=bool(output_hidden_states))


def _build(cfg: CLIPTextConfig, seed: int = 0, dtype=np.float32):
    return lambda: CLIPText(cfg, rngs=nnx.Rngs(seed), param_dtype=dtype)


def init(cfg: CLIPTextConfig, seed: int = 0, dtype=np.float32) -> CLIPTextEncoder:
    """Seeded random weights (tiny presets, tests): every parameter perturbed, made on the host."""
    from vidax.text.lm import random_params

    return from_params(cfg, random_params(param_shapes(cfg, dtype), seed, dtype=dtype))


def param_shapes(cfg: CLIPTextConfig, dtype=np.float32) -> dict:
    return nn.shapes(_build(cfg, dtype=dtype))


def abstract(cfg: CLIPTextConfig, dtype=np.float32) -> CLIPTextEncoder:
    return CLIPTextEncoder(*nn.abstract_state(_build(cfg, dtype=dtype)), cfg)


def _dtype_of(params) -> np.dtype:
    """Storage dtype of a parameter tree (the module is built with it so equal trees share compiles)."""
    return np.dtype(jax.tree.leaves(params)[0].dtype)


def from_params(cfg: CLIPTextConfig, params: dict, device_put: bool = True) -> CLIPTextEncoder:
    return CLIPTextEncoder.from_pure(_build(cfg, dtype=_dtype_of(params)), params, device_put=device_put)


# ---------------------------------------------------------------------------------------------
# key maps and loading
# ---------------------------------------------------------------------------------------------
def hf_prefix(names) -> str:
    return "text_model." if any(n.startswith("text_model.") for n in names) else ""


def hf_keymap(cfg: CLIPTextConfig, prefix: str = "text_model.") -> KeyMap:
    """transformers naming under ``prefix`` (``"text_model."`` or ``""``). Ignored: a
    ``CLIPModel``'s vision half and ``logit_scale``, the ``position_ids`` buffer older files saved."""
    p = prefix
    rules = [Rule(p + "embeddings.token_embedding.weight", "token.embedding"),
             Rule(p + "embeddings.position_embedding.weight", "pos.embedding"),
             Rule(p + "final_layer_norm.weight", "final_norm.scale"),
             Rule(p + "final_layer_norm.bias", "final_norm.bias")] + encoder.block_rules(p + "encoder.")
    if cfg.projection_dim is not None:
        rules.append(Rule("text_projection.weight", "proj.kernel", "linear"))
    ignore = [r"position_ids$", r"^vision_model\.", r"^visual_projection\.", r"^logit_scale$"]
    if cfg.projection_dim is None:
        ignore.append(r"^text_projection\.")
    return KeyMap(rules, ignore=ignore)


def load_params_from(ckpt, cfg: CLIPTextConfig, dtype=np.float32) -> dict:
    prefix = hf_prefix(list(ckpt))
    return load_params(ckpt, hf_keymap(cfg, prefix), param_shapes(cfg, dtype), dtype=dtype,
                       what=f"CLIP text tower (prefix {prefix!r})")


def load_clip_text(path, cfg: CLIPTextConfig | None = None, dtype=np.float32, device_put: bool = True) -> CLIPTextEncoder:
    """A CLIP text tower from a transformers folder (a diffusers pipeline folder's
    ``text_encoder_2/`` or ``text_encoder/`` is found). ``dtype``: storage dtype (compute is float32)."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists():
        for sub in ("text_encoder_2", "text_encoder"):
            cj = p / sub / "config.json"
            if cj.exists() and "CLIP" in " ".join(json.loads(cj.read_text()).get("architectures") or []):
                p = p / sub
                break
    if cfg is None:
        cfg = CLIPTextConfig.from_hf(json.loads((p / "config.json").read_text()))
    return from_params(cfg, load_params_from(open_checkpoint(p), cfg, dtype=dtype), device_put=device_put)


# ---------------------------------------------------------------------------------------------
# compat adapter
# ---------------------------------------------------------------------------------------------
class _CLIPTextCompat(CompatModel):
    """``forward`` returns the reference's first output: ``last_hidden_state`` (``CLIPTextModel``)
    or ``text_embeds`` (``...WithProjection``); ``outputs(...)`` / ``cm(...)`` all of them."""

    def __init__(self, name: str, config: dict, enc: CLIPTextEncoder):
        super().__init__(name, config, enc.state, model_config=enc.cfg)
        self.encoder = enc

    def outputs(self, input_ids=None, attention_mask=None, position_ids=None, output_hidden_states=False,
                **kwargs) -> Output:
        check_kwargs(self.name, kwargs)
        if input_ids is None:
            raise ValueError("You have to specify input_ids")
        out = self.encoder(np.asarray(input_ids), None if attention_mask is None else np.asarray(attention_mask),
                           None if position_ids is None else np.asarray(position_ids),
                           output_hidden_states=bool(output_hidden_states))
        order = ("text_embeds", "last_hidden_state") if "text_embeds" in out else ("last_hidden_state", "pooler_output")
        res = Output((k, np.asarray(out[k])) for k in order)
        if "text_embeds" in out:
            res["pooler_output"] = np.asarray(out["pooler_output"])
        if output_hidden_states:
            res["hidden_states"] = tuple(np.asarray(out["hidden_states"]))
        return res

    __call__ = outputs

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, output_hidden_states=False, **kwargs):
        return next(iter(self.outputs(input_ids, attention_mask, position_ids, False, **kwargs).values()))


@register("CLIPTextModel", "CLIPTextModelWithProjection")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **kw) -> CompatModel:
    name = (config.get("architectures") or ["CLIPTextModel"])[0]
    cfg = CLIPTextConfig.from_hf(config, with_projection=name == "CLIPTextModelWithProjection")
    return _CLIPTextCompat(name, config, from_params(cfg, load_params_from(open_checkpoint(folder), cfg, dtype=dtype)))


__all__ = ["CLIPTextConfig", "CLIPText", "CLIPTextEncoder", "init", "param_shapes", "abstract", "from_params",
           "hf_prefix", "hf_keymap", "load_params_from", "load_clip_text"]
