"""HunyuanVideo LoRA names: the diffusers layout (``transformer_blocks.0.attn.to_q``,
``single_transformer_blocks.0.proj_mlp``). The original release's LoRAs adapt its fused
projections (``double_blocks.0.img_attn_qkv``, ``single_blocks.0.linear1``), which diffusers splits
on conversion; they are not read here yet: their keys are reported as matching no module."""
from __future__ import annotations

from vidax.weights.lora import identity_aliases


def aliases(cfg=None):
    return identity_aliases


def compat_aliases(class_name: str, config: dict):
    if class_name != "HunyuanVideoTransformer3DModel":
        raise KeyError(class_name)
    return identity_aliases
