"""HunyuanVideo's prompt conditioning: the Llama-3 tower's hidden states after the prompt template
(template prefix cropped, mask carried) and the CLIP-L text tower's pooled output; for
image-to-video the LLaVA tower with the image's tokens spliced into the prompt.

What the diffusers pipelines do, step by step, and where it is here:

- text-to-video (``HunyuanVideoPipeline._get_llama_prompt_embeds``): the prompt goes into
  :data:`T2V_TEMPLATE`, is tokenized to ``256 + crop_start`` tokens (right padding, truncation),
  the LM runs with the mask and the hidden state **two layers below the top**
  (``hidden_states[-3]``) is taken; the first ``crop_start`` (95: the template's system prompt)
  positions are dropped from embeddings and mask -> ``[B, 256, 4096]`` + ``[B, 256]``
  (:func:`llama_embeds`);
- pooled text (``_get_clip_prompt_embeds``): CLIP-L's ``pooler_output`` of the prompt tokenized
  to 77 (truncated, no attention mask, as the reference calls it) -> ``[B, 768]``
  (:func:`clip_pooled`);
- image-to-video (``HunyuanVideoImageToVideoPipeline``): :data:`I2V_TEMPLATE` holds one
  ``<image>`` token; it is expanded to the image's 576 LLaVA tokens (CLIP ViT-L/336 penultimate
  features without CLS, through the multimodal projector), the LM runs on the spliced embeddings,
  and the result is rearranged: the image's hidden states (every ``image_embed_interleave``-th)
  first, then the prompt's (template prefix and the assistant header cut out)
  (:func:`llava_embeds`).

Every encode runs in float32 (the encoders' own rule).
"""
from __future__ import annotations

import numpy as np

T2V_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)
T2V_CROP_START = 95  # tokens of the template before the prompt (Llama-3 tokenizer, BOS included)

I2V_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\n<image>\nDescribe the video by detailing the following aspects "
    "according to the reference image: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>\n\n"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
I2V_CROP_START = 103
IMAGE_EMB_START, IMAGE_EMB_END, IMAGE_EMB_LEN = 5, 581, 576

MAX_TEXT_TOKENS = 256  # the pipelines' max_sequence_length (tokens after the template prefix)
CLIP_TOKENS = 77
HIDDEN_INDEX = -3  # num_hidden_layers_to_skip=2: hidden_states[-(2 + 1)]


def llama_embeds(tokenizer, lm, prompts, template: str = T2V_TEMPLATE, crop_start: int = T2V_CROP_START,
                 max_tokens: int = MAX_TEXT_TOKENS, index: int = HIDDEN_INDEX):
    """``(embeds [B, max_tokens, D] float32, mask [B, max_tokens] int32)`` (text-to-video)."""
    texts = [template.format(p) for p in prompts]
    ids, mask = tokenizer(texts, max_tokens + crop_start)
    h = np.asarray(lm.layer(np.asarray(ids), np.asarray(mask), index=index), np.float32)
    return h[:, crop_start:], np.asarray(mask)[:, crop_start:].astype(np.int32)


def clip_pooled(tokenizer, clip, prompts, max_tokens: int = CLIP_TOKENS) -> np.ndarray:
    """CLIP text ``pooler_output`` [B, D] float32 of the prompts (no template)."""
    ids, _ = tokenizer(list(prompts), max_tokens)
    return np.asarray(clip(np.asarray(ids))["pooler_output"], np.float32)


def template_tokens(tokenizer, template: str) -> int:
    """Tokens of the template before the prompt, special tokens included (``crop_start`` for a
    tokenizer other than the release's Llama-3 one, e.g. the presets' :class:`PresetTokenizer`)."""
    return len(tokenizer.encode(template.split("{}")[0]))


class PresetTokenizer:
    """The presets' Llama-style tokenizer without a vocabulary file: a BOS, then utf-8 bytes
    (+ 8), the template's special tokens whole; right padding with 0, no end token (as Llama 3's)."""

    pad_id, bos_id = 0, 1
    specials = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>")
    offset = 8
    vocab_size = 256 + 8

    def token_id(self, token: str) -> int:
        return 2 + self.specials.index(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = [self.bos_id] if add_special_tokens else []
        i = 0
        while i < len(text):
            for k, s in enumerate(self.specials):
                if text.startswith(s, i):
                    out.append(2 + k)
                    i += len(s)
                    break
            else:
                out.extend(b + self.offset for b in text[i].encode("utf-8"))
                i += 1
        return out

    def __call__(self, prompts, max_length: int):
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = np.zeros((len(prompts), max_length), np.int32)
        mask = np.zeros((len(prompts), max_length), np.int32)
        for r, p in enumerate(prompts):
            e = self.encode(p)[:max_length]
            ids[r, :len(e)], mask[r, :len(e)] = e, 1
        return ids, mask

    def count(self, prompts) -> list[int]:
        return [len(self.encode(p)) for p in ([prompts] if isinstance(prompts, str) else prompts)]


def prompt_tokens(tokenizer, prompts, template: str, crop_start: int) -> list[int]:
    """Prompt tokens after the template prefix (what must fit :data:`MAX_TEXT_TOKENS`)."""
    return [n - crop_start for n in tokenizer.count([template.format(p) for p in prompts])]


# ----------------------------------------------------------------------------------- LLaVA (I2V)
def expand_image_tokens(ids, mask, image_token_id: int, pad_id: int, image_len: int = IMAGE_EMB_LEN,
                        start: int = IMAGE_EMB_START, end: int = IMAGE_EMB_END):
    """The reference's ``_expand_input_ids_with_image_tokens``: each ``<image>`` id becomes
    ``image_len`` ids; the new mask marks every non-pad id; positions count the mask. Returns
    ``(ids, mask, positions)`` int32 of length ``T + (image_len - 1) * max(#images)``."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    b, t = ids.shape
    special = ids == image_token_id
    n_special = special.sum(-1)
    n = t + int(n_special.max()) * (image_len - 1)
    new_pos = np.cumsum(special * (image_len - 1) + 1, axis=-1) - 1
    out = np.full((b, n), pad_id, ids.dtype)
    for r in range(b):
        keep = ~special[r]
        out[r, new_pos[r][keep]] = ids[r][keep]
        out[r, start:end] = image_token_id
    m = (out != pad_id).astype(np.int32)
    pos = np.where(m == 0, 1, np.cumsum(m, axis=-1) - 1).astype(np.int32)
    return out.astype(np.int32), m, pos


def llava_embeds(tokenizer, llava, pixel_values, prompts, *, image_token_id: int, pad_id: int, end_header_id: int,
                 template: str = I2V_TEMPLATE, crop_start: int = I2V_CROP_START, max_tokens: int = MAX_TEXT_TOKENS,
                 image_embed_interleave: int = 2, image_len: int = IMAGE_EMB_LEN, image_start: int = IMAGE_EMB_START,
                 image_end: int = IMAGE_EMB_END, index: int = HIDDEN_INDEX):
    """Image-to-video prompt conditioning (``HunyuanVideoImageToVideoPipeline._get_llama_prompt_embeds``).
    ``llava``: a :class:`vidax.models.hunyuanvideo.llava.LlavaEncoder`; ``pixel_values``: the
    preprocessed image [1, 3, S, S] (one image, used for every prompt). Returns
    ``(embeds [B, L, D] float32, mask [B, L] int32)``: the image's hidden states (every
    ``image_embed_interleave``-th) followed by the prompt's."""
    texts = [template.format(p) for p in prompts]
    ids, mask = tokenizer(texts, max_tokens + crop_start)
    ids, mask = np.asarray(ids), np.asarray(mask)
    eids, emask, pos = expand_image_tokens(ids, mask, image_token_id, pad_id, image_len, image_start, image_end)
    h = np.asarray(llava.hidden_state(eids, emask, pos, pixel_values, index=index), np.float32)
    text_crop = crop_start - 1 + image_len
    embeds, masks = [], []
    for r in range(ids.shape[0]):
        heads = np.nonzero(ids[r] == end_header_id)[0]
        # the assistant header is the last <|end_header_id|>; a prompt cut by truncation loses it
        # (the reference then takes the last position, for a batch of one)
        a = int(heads[-1]) + 1 if len(heads) >= 3 else ids.shape[1]
        emb = np.concatenate([h[r, text_crop:a - 1 + image_len - 4], h[r, a - 1 + image_len:]], axis=0)
        msk = np.concatenate([mask[r, crop_start:a - 4], mask[r, a:]], axis=0)
        embeds.append(emb)
        masks.append(msk)
    img = h[:, image_start:image_end]
    img_mask = np.ones(img.shape[:2], np.int32)
    if 0 < image_embed_interleave < 6:
        img, img_mask = img[:, ::image_embed_interleave], img_mask[:, ::image_embed_interleave]
    return (np.concatenate([img, np.stack(embeds)], axis=1).astype(np.float32),
            np.concatenate([img_mask, np.stack(masks)], axis=1).astype(np.int32))
