"""Cosmos-Predict2.5 LoRA names: the diffusers layout (``transformer_blocks.0.attn1.to_q``) and the
original release's (``net.blocks.0.self_attn.q_proj``), both built from :mod:`~.dit`'s key map."""
from __future__ import annotations

from vidax.models.cosmos import dit as cdit
from vidax.weights.lora import two_layout_aliases


def aliases(cfg: cdit.CosmosDiTConfig):
    return two_layout_aliases(cdit.diffusers_keymap(cfg), cdit.original_keymap(cfg), cdit._is_original)


def compat_aliases(class_name: str, config: dict):
    if class_name != "CosmosTransformer3DModel":
        raise KeyError(class_name)
    return aliases(cdit.CosmosDiTConfig.from_diffusers(config))
