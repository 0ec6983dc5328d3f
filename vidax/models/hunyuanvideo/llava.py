"""The LLaVA text tower of HunyuanVideo image-to-video (transformers ``LlavaForConditionalGeneration``,
``xtuner/llava-llama-3-8b``-shaped), as the I2V pipeline runs it: CLIP ViT-L/336's penultimate
features without the class token (``vision_feature_layer=-2``, ``"default"`` selection), the
multimodal projector (linear, GELU, linear), the features written over the ``<image>`` positions of
the token embeddings, then the Llama stack's hidden states. Built from the shared encoders
(:mod:`vidax.text.clip` vision tower, :mod:`vidax.text.lm`); only the projector is new. Float32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax.core import nn
from vidax.text import clip as clipmod
from vidax.text import lm as lmmod
from vidax.weights import Checkpoint, KeyMap, Rule, load_params, open_checkpoint


@dataclass(frozen=True)
class LlavaSettings:
    image_token_id: int
    pad_id: int
    vision_feature_layer: int = -2
    select_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True


class Projector(nnx.Module):
    def __init__(self, dv: int, d: int, act: str, bias: bool, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        hi = jax.lax.Precision.HIGHEST
        self.linear_1 = nn.Linear(dv, d, rngs=rngs, bias=bias, param_dtype=param_dtype, precision=hi)
        self.linear_2 = nn.Linear(d, d, rngs=rngs, bias=bias, param_dtype=param_dtype, precision=hi)
        self.act = act

    def __call__(self, x):
        x = jnp.asarray(x, jnp.float32)
        return self.linear_2(nn.activation(self.act)(self.linear_1(x)).astype(jnp.float32)).astype(jnp.float32)


class LlavaEncoder:
    """Vision tower + projector + LM (each split once; one jitted program per piece and shape)."""

    def __init__(self, vision: clipmod.CLIPVisionEncoder, projector: nn.Split, lm: lmmod.LMEncoder, s: LlavaSettings):
        if s.vision_feature_layer != -2 or s.select_strategy != "default":
            raise ValueError(f"LLaVA vision_feature_layer={s.vision_feature_layer}, strategy={s.select_strategy!r}: "
                             f"only -2 / 'default' (HunyuanVideo's text encoder) is supported")
        self.vision, self.projector, self.lm, self.settings = vision, projector, lm, s

    @property
    def image_token_id(self) -> int:
        return self.settings.image_token_id

    @property
    def pad_id(self) -> int:
        return self.settings.pad_id

    @property
    def image_tokens(self) -> int:
        return self.vision.cfg.grid ** 2

    def image_features(self, pixel_values):
        """[B, 3, S, S] -> projected patch features [B, N, D] (no class token)."""
        pen = self.vision.penultimate(jnp.asarray(pixel_values, jnp.float32))
        return self.projector(pen[:, 1:])

    def hidden_state(self, ids, mask, positions, pixel_values, index: int = -3):
        """``hidden_states[index]`` [B, T, D] of the LM over ``ids`` whose ``<image>`` positions hold
        the image's features (in order; the same image for every row)."""
        ids = jnp.asarray(ids, jnp.int32)
        feats = self.image_features(pixel_values)[0]  # [N, D]
        emb = self.lm.apply("embed_tokens", ids)
        spots = ids == self.image_token_id
        order = jnp.clip(jnp.cumsum(spots, axis=1) - 1, 0, feats.shape[0] - 1)
        emb = jnp.where(spots[..., None], feats[order], emb)
        hs = self.lm.hidden_states_embeds(emb, jnp.asarray(mask), jnp.asarray(positions))
        return hs[index]


def _proj_build(dv, d, s: LlavaSettings, dtype=np.float32):
    return lambda: Projector(dv, d, s.projector_act, s.projector_bias, rngs=nnx.Rngs(0), param_dtype=dtype)


def init(vision_cfg: clipmod.CLIPVisionConfig, lm: lmmod.LMEncoder, *, seed: int = 0, image_token_id: int,
         pad_id: int) -> LlavaEncoder:
    """Seeded random vision tower + projector around an LM (presets, tests)."""
    from vidax.models.hunyuanvideo.dit import seeded_state

    s = LlavaSettings(image_token_id, pad_id)
    vision = clipmod.from_params(vision_cfg, nnx.to_pure_dict(
        seeded_state(lambda: clipmod.CLIPVision(vision_cfg, rngs=nnx.Rngs(0)), seed)[1]))
    graphdef, state = seeded_state(_proj_build(vision_cfg.hidden_size, lm.cfg.hidden_size, s), seed + 1)
    return LlavaEncoder(vision, nn.Split(graphdef, jax.device_put(state)), lm, s)


def settings_from_hf(config: dict) -> LlavaSettings:
    tc = config.get("text_config") or {}
    tok = config.get("image_token_index", config.get("image_token_id"))
    pad = config.get("pad_token_id", tc.get("pad_token_id"))
    if tok is None or pad is None:
        raise ValueError("LLaVA config: image_token_index and pad_token_id are needed")
    return LlavaSettings(int(tok), int(pad), int(config.get("vision_feature_layer", -2)),
                         str(config.get("vision_feature_select_strategy", "default")),
                         str(config.get("projector_hidden_act", "gelu")), bool(config.get("multimodal_projector_bias", True)))


def _prefix_view(ckpt, marker: str) -> dict:
    """The tensors whose name contains ``marker``, renamed to what follows it."""
    out = {}
    for n in ckpt:
        i = n.find(marker)
        if i >= 0:
            out[n[i + len(marker):]] = ckpt[n]
    return Checkpoint(out, ckpt.source) if isinstance(ckpt, Checkpoint) else out  # (errors name the folder)


def _open(folder):
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    return config, settings_from_hf(config), clipmod.CLIPVisionConfig.from_hf(config["vision_config"]), open_checkpoint(folder)


def load_vision_tower(folder) -> clipmod.CLIPVisionEncoder:
    """The LLaVA folder's CLIP vision tower (``vision_tower.*``)."""
    _, _, vcfg, ckpt = _open(folder)
    return clipmod.from_params(vcfg, clipmod.load_params_from(_prefix_view(ckpt, "vision_tower."), vcfg, naming="hf"))


def load_projector(folder, lm_hidden: int | None = None) -> nn.Split:
    """The LLaVA folder's multimodal projector (``multi_modal_projector.*``): vision width -> the
    LM's (``lm_hidden``, default from the config)."""
    config, s, vcfg, ckpt = _open(folder)
    if lm_hidden is None:
        lm_hidden = lmmod.LMConfig.from_hf(config).hidden_size
    rules = [Rule("linear_1.weight", "linear_1.kernel", "linear"), Rule("linear_2.weight", "linear_2.kernel", "linear")]
    if s.projector_bias:
        rules += [Rule("linear_1.bias", "linear_1.bias"), Rule("linear_2.bias", "linear_2.bias")]
    build = _proj_build(vcfg.hidden_size, lm_hidden, s)
    pure = load_params(_prefix_view(ckpt, "multi_modal_projector."), KeyMap(rules), nn.shapes(build), dtype=np.float32,
                       what="LLaVA multimodal projector")
    return nn.Split.from_pure(build, pure)


def load_llava(folder, mesh=None) -> LlavaEncoder:
    """A transformers ``LlavaForConditionalGeneration`` folder (hub naming ``vision_tower.* /
    multi_modal_projector.* / language_model.*`` or transformers 5's ``model.*``). ``mesh``: the
    LM's tensor-parallel mesh (:func:`vidax.text.lm.load_lm`); the vision tower and projector are small.
    Its three parts load apart (:func:`load_vision_tower`, :func:`load_projector`, the LM), which
    is how validation checks each one's headers."""
    config = json.loads((Path(folder) / "config.json").read_text())
    s = settings_from_hf(config)
    vision = load_vision_tower(folder)
    lm = lmmod.load_lm(folder, dtype=np.float32, mesh=mesh)
    return LlavaEncoder(vision, load_projector(folder, lm.cfg.hidden_size), lm, s)
