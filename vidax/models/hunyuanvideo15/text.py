"""HunyuanVideo 1.5's prompt conditioning, as the diffusers pipelines build it.

- **Qwen2.5-VL text** (``_get_mllm_prompt_embeds``): the prompt (an empty one becomes ``" "``) goes
  into the Qwen chat template with the pipelines' system message and the generation prompt, is
  tokenized to ``1000 + 108`` tokens (right padding, truncation), the text tower runs with the
  mask, the hidden state **two layers below the top** (``hidden_states[-3]``) is taken and the
  first 108 positions (the system prompt) are cropped from embeddings and mask ->
  ``[B, 1000, 3584]`` + ``[B, 1000]`` (:func:`qwen_embeds`);
- **ByT5 glyphs** (``_get_byt5_prompt_embeds``): the quoted spans of the prompt (``"..."`` or
  ``“...”``; duplicates dropped when there are several) become ``Text "a". Text "b". `` and are
  encoded by the Glyph-ByT5 encoder to 256 tokens with their mask; a prompt without quotes gets
  zeros and an all-zero mask (:func:`extract_glyph_text`, :func:`glyph_embeds`);
- **SigLIP image** (image-to-video): ``last_hidden_state`` of the image resized to 384 px
  (:func:`vidax.text.siglip.preprocess`) -> ``[1, 729, 1152]``; text-to-video passes zeros.

The encoders are vidax's shared ones (:mod:`vidax.text.lm`, :mod:`vidax.text.t5` +
:mod:`vidax.text.byt5`, :mod:`vidax.text.siglip`); every encode runs in float32.
"""
from __future__ import annotations

import re

import numpy as np

from vidax.models.hunyuanvideo.text import PresetTokenizer

SYSTEM_MESSAGE = ("You are a helpful assistant. Describe the video by detailing the following aspects:" + "".join(
    "         " + s for s in (
        "1. The main content and theme of the video.",
        "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.",
        "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.",
        "4. background environment, light, style and atmosphere.",
        "5. camera angles, movements, and transitions used in the video.")))
CROP_START = 108  # the template's tokens before the prompt (Qwen2.5-VL tokenizer), the pipelines' constant
MAX_TEXT_TOKENS = 1000
GLYPH_TOKENS = 256
HIDDEN_INDEX = -3  # num_hidden_layers_to_skip=2
IMAGE_TOKENS = 729  # SigLIP so400m at 384 px: 27 x 27


def chat_text(prompt: str, system: str = SYSTEM_MESSAGE) -> str:
    """The Qwen2 chat template rendered for ``[system, user]`` with the generation prompt."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt if prompt else ' '}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def template_prefix_tokens(tokenizer) -> int:
    """Tokens before the prompt in :func:`chat_text` for this tokenizer (the presets' crop)."""
    return len(tokenizer.encode(chat_text("\x00").split("\x00")[0]))


def qwen_embeds(tokenizer, lm, prompts, crop_start: int = CROP_START, max_tokens: int = MAX_TEXT_TOKENS,
                index: int = HIDDEN_INDEX):
    """``(embeds [B, max_tokens, D] float32, mask [B, max_tokens] int32)``."""
    ids, mask = tokenizer([chat_text(p) for p in prompts], max_tokens + crop_start)
    h = np.asarray(lm.layer(np.asarray(ids), np.asarray(mask), index=index), np.float32)
    return h[:, crop_start:], np.asarray(mask)[:, crop_start:].astype(np.int32)


def prompt_tokens(tokenizer, prompts, crop_start: int = CROP_START) -> list[int]:
    """Prompt tokens after the template prefix (what must fit :data:`MAX_TEXT_TOKENS`)."""
    return [n - crop_start for n in tokenizer.count([chat_text(p) for p in prompts])]


_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")


def extract_glyph_text(prompt: str) -> str | None:
    """The pipelines' ``extract_glyph_texts``: ``Text "a". Text "b". `` from the quoted spans, or None."""
    found = [a or b for a, b in _QUOTED.findall(prompt)]
    if len(found) > 1:
        found = list(dict.fromkeys(found))
    return ". ".join(f'Text "{t}"' for t in found) + ". " if found else None


def glyph_embeds(tokenizer, t5, prompts, d_model: int, max_tokens: int = GLYPH_TOKENS):
    """``(embeds [B, max_tokens, d_model] float32, mask [B, max_tokens] int32)``; zeros for a
    prompt without quoted text."""
    embs, masks = [], []
    for p in prompts:
        g = extract_glyph_text(p)
        if g is None:
            embs.append(np.zeros((max_tokens, d_model), np.float32))
            masks.append(np.zeros((max_tokens,), np.int32))
            continue
        ids, mask = tokenizer([g], max_tokens)
        embs.append(np.asarray(t5(np.asarray(ids), np.asarray(mask, np.float32)), np.float32)[0])
        masks.append(np.asarray(mask, np.int32)[0])
    return np.stack(embs), np.stack(masks)


class PresetQwenTokenizer(PresetTokenizer):
    """The presets' byte tokenizer with the Qwen chat template's special tokens (no BOS)."""

    specials = ("<|im_start|>", "<|im_end|>")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return super().encode(text, add_special_tokens=False)
