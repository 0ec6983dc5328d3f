"""Cosmos-Predict2.5's text conditioning: a Qwen2.5-VL reasoning model (Cosmos-Reason1-7B) reads
the chat-formatted prompt and **every** layer's hidden states are normalised and concatenated.

The reference (``Cosmos2_5_PredictBasePipeline._get_prompt_embeds``):

- the prompt becomes a two-message chat (a fixed system prompt, then the user's text), tokenized
  with the tokenizer's chat template, padded (right, the pad token) to ``max_sequence_length`` = 512;
- the text encoder runs **without** an attention mask (pad positions are ordinary tokens under the
  causal mask, and their features are used);
- for each layer ``l = 1 .. L`` (the embedding output is skipped; entry ``L`` is the final-normed
  output, as transformers returns it): ``(h - mean) / (std + 1e-8)`` over the features, ``std`` with
  Bessel's correction (``torch.std``), then the ``L`` results are concatenated on features
  (28 x 3584 = 100352 channels for the 7B model), which the DiT projects to 1024.

Each per-layer block therefore has zero mean and unit (unbiased) standard deviation per token; the
scale of the conditioning never depends on the encoder's activation magnitudes (see
``tests/test_cosmos_pipeline.py`` for the check against the reference).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vidax.models.cosmos import chat

SYSTEM_PROMPT = "You are a helpful assistant who will provide prompts to an image generator."
MAX_LENGTH = 512
DEFAULT_NEGATIVE_PROMPT = (
    "The video captures a series of frames showing ugly scenes, static with no motion, motion blur, "
    "over-saturation, shaky footage, low resolution, grainy texture, pixelated images, poorly lit areas, "
    "underexposed and overexposed scenes, poor color balance, washed out colors, choppy sequences, "
    "jerky movements, low frame rate, artifacting, color banding, unnatural transitions, outdated special effects, "
    "fake elements, unconvincing visuals, poorly edited content, jump cuts, visual noise, and flickering. "
    "Overall, the video is of poor quality."
)


def conversation(prompt: str) -> list[dict]:
    return [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
            {"role": "user", "content": [{"type": "text", "text": prompt}]}]


def token_lengths(tokenizer, prompts, template=None, specials=None) -> list[int]:
    return [len(chat.encode(tokenizer, chat.render(conversation(p), template, specials=specials,
                                                   add_vision_id=False))) for p in prompts]


def token_ids(tokenizer, prompts, max_length: int = MAX_LENGTH, template=None, specials=None, pad_id=None,
              padding_side: str = "right") -> np.ndarray:
    """int32 [B, max_length]: the chat-formatted prompts, padded (a longer prompt is an error)."""
    seqs = [chat.encode(tokenizer, chat.render(conversation(p), template, specials=specials, add_vision_id=False))
            for p in prompts]
    pid = tokenizer.pad_id if pad_id is None else pad_id
    return chat.pad(seqs, max_length, pid, padding_side)


@jax.jit
def normalize_concat(hidden_states):
    """[L+1, B, T, D] (every layer, the embeddings first) -> [B, T, L*D]: layers 1..L each
    standardised over features (mean 0, unbiased std 1, eps 1e-8 on the std), concatenated."""
    h = jnp.asarray(hidden_states, jnp.float32)[1:]
    mu = jnp.mean(h, axis=-1, keepdims=True)
    d = h.shape[-1]
    std = jnp.sqrt(jnp.sum(jnp.square(h - mu), axis=-1, keepdims=True) / (d - 1))
    n = (h - mu) / (std + 1e-8)
    return jnp.transpose(n, (1, 2, 0, 3)).reshape(n.shape[1], n.shape[2], -1)


def prompt_embeds(encoder, input_ids) -> np.ndarray:
    """Text features [B, T, L*D] float32 for token ids [B, T] (no attention mask, as the reference)."""
    return np.asarray(normalize_concat(encoder.hidden_states(jnp.asarray(input_ids))), np.float32)
