"""Wan LoRA names: the alias table beside the DiT's key maps.

A Wan LoRA names its modules either as diffusers does (``blocks.0.attn1.to_q``, PEFT / diffusers
training scripts) or as the original release does (``blocks.0.self_attn.q``: ComfyUI, kohya,
musubi-tuner, AI-Toolkit, the lightx2v / CausVid distillation LoRAs). Both key maps of
:mod:`vidax.models.wan.dit` map onto the same vidax parameters, so a checkpoint in either layout
answers to both sets of names.
"""
from __future__ import annotations

from pathlib import Path

from vidax.models.wan import dit as wdit
from vidax.weights.lora import Target, two_layout_aliases

def aliases(cfg: wdit.WanDiTConfig):
    """``names -> {alias: name}`` for a Wan DiT checkpoint with config ``cfg``."""
    return two_layout_aliases(wdit.diffusers_keymap(cfg), wdit.original_keymap(cfg), wdit._is_original)


def target(name: str, path: Path, cfg: wdit.WanDiTConfig, what: str) -> Target:
    return Target(name, Path(path), aliases(cfg), what)


def compat_aliases(class_name: str, config: dict):
    """For ``vidax.compat.load_pretrained(folder, lora=...)``."""
    if class_name != "WanTransformer3DModel":
        raise KeyError(class_name)
    return aliases(wdit.WanDiTConfig.from_diffusers(config))
