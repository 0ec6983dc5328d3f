"""CogVideoX LoRA names: diffusers' CogVideoX loader reads the diffusers / PEFT layout only
(``transformer.transformer_blocks.0.attn1.to_q.lora_A.weight``), as here; the kohya-style
``lora_down`` / ``lora_up`` + ``alpha`` and LyCORIS ``diff`` keys on the same module names are read
too (:mod:`vidax.weights.lora`)."""
from __future__ import annotations

from vidax.weights.lora import identity_aliases


def aliases(cfg=None):
    return identity_aliases


def compat_aliases(class_name: str, config: dict):
    if class_name != "CogVideoXTransformer3DModel":
        raise KeyError(class_name)
    return identity_aliases
