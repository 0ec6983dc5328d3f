"""LTX-Video and LTX-2 LoRA names: the diffusers layout and the original release's
(``patchify_proj``, ``adaln_single``, ``q_norm``: ComfyUI / LTX-Video-Trainer LoRAs, under
``diffusion_model.``), both built from the DiTs' key maps."""
from __future__ import annotations

from vidax.models.ltx import dit as ldit
from vidax.models.ltx import dit2 as ldit2
from vidax.weights.lora import two_layout_aliases


def aliases(cfg: ldit.LTXDiTConfig):
    return two_layout_aliases(ldit.diffusers_keymap(cfg), ldit.original_keymap(cfg), ldit._is_original)


def aliases2(cfg: ldit2.LTX2DiTConfig):
    return two_layout_aliases(ldit2.diffusers_keymap(cfg), ldit2.original_keymap(cfg), ldit2._is_original)


def compat_aliases(class_name: str, config: dict):
    if class_name == "LTXVideoTransformer3DModel":
        return aliases(ldit.LTXDiTConfig.from_diffusers(config))
    if class_name == "LTX2VideoTransformer3DModel":
        return aliases2(ldit2.LTX2DiTConfig.from_diffusers(config))
    raise KeyError(class_name)
