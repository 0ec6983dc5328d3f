"""LTX-Video and LTX-2 LoRA names: the diffusers layout and the original release's
(``patchify_proj``, ``adaln_single``, ``q_norm``: ComfyUI / LTX-Video-Trainer LoRAs, under
``diffusion_model.``), both built from the DiTs' key maps."""
from __future__ import annotations

from vidax.models.ltx import dit as ldit
from vidax.models.ltx import dit2 as ldit2
from vidax.weights.lora import Target, two_layout_aliases

#: where a LoRA keeps the LTX-2 text connectors' modules: diffusers ``connectors.``, the original
#: release (ComfyUI) ``text_embedding_projection.``
CONNECTOR_CLAIMS = ("connectors.", "text_embedding_projection.")
_CONNECTOR_RENAMES = (("aggregate_embed", "text_proj_in"),)


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


def connector_aliases(shapes) -> dict:
    """The LTX-2 connectors' names, and the original release's for them (``aggregate_embed``)."""
    out = {n: n for n in shapes}
    for n in shapes:
        for orig, dif in _CONNECTOR_RENAMES:
            if n.startswith(dif + "."):
                out.setdefault(orig + n[len(dif):], n)
    return out


def connectors_target(path) -> Target:
    """The text connectors as a LoRA target: they run in the encode stage, so a LoRA with connector
    keys enters the encode stage's key."""
    from pathlib import Path

    return Target("connectors", Path(path), connector_aliases, "the LTX-2 text connectors (connectors)",
                  claims=CONNECTOR_CLAIMS, stage="encode")
