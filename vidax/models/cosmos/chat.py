"""Chat-formatted prompts, as the Cosmos pipelines tokenize them (``tokenizer.apply_chat_template``).

A checkpoint's tokenizer folder ships its chat template (``chat_template.jinja``,
``chat_template.json`` or the ``chat_template`` entry of ``tokenizer_config.json``); it is rendered
here in a sandboxed jinja2 environment configured as transformers configures it (``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception`` / ``strftime_now``, a non-escaping
``tojson``), with the tokenizer's special tokens visible to the template, then tokenized without
adding special tokens (transformers' ``apply_chat_template(tokenize=True)``).

Without a template (the tiny presets' :class:`WordTokenizer`), :data:`CHATML` (Qwen's format) is used.
"""
from __future__ import annotations

import json
import re
import zlib
from datetime import datetime
from pathlib import Path

import numpy as np

#: Qwen-style ChatML for string or ``[{"type": "text", "text": ...}]`` contents (the tiny presets)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class WordTokenizer:
    """The tiny presets' tokenizer: ChatML special tokens whole, every other word or punctuation
    mark hashed (CRC-32) into the vocabulary. Dependency-free and short sequences (the default
    negative prompts stay ~150 tokens), so the seeded-weight presets run in seconds."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
    pad_id = 0

    def __init__(self, vocab_size: int = 384):
        self.vocab_size = vocab_size
        self._split = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIALS) + r")|(\w+|[^\w\s])")

    def token_to_id(self, token: str) -> int | None:
        return self.SPECIALS.index(token) if token in self.SPECIALS else None

    def encode(self, text: str) -> list[int]:
        out = []
        for special, word in self._split.findall(text):
            if special:
                out.append(self.SPECIALS.index(special))
            else:
                out.append(len(self.SPECIALS) + zlib.crc32(word.encode()) % (self.vocab_size - len(self.SPECIALS)))
        return out

    def count(self, prompts) -> list[int]:
        return [len(self.encode(p)) for p in ([prompts] if isinstance(prompts, str) else prompts)]


def load_template(folder) -> str | None:
    """The chat template a tokenizer folder ships (None if it has none)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        p = folder / name
        if p.exists():
            t = json.loads(p.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(t, list):  # named templates: the default one
                t = next((x.get("template") for x in t if x.get("name") == "default"), None)
            if isinstance(t, str):
                return t
    return None


def special_tokens(folder) -> dict:
    """``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` as the template sees them."""
    if folder is None:
        return {}
    cfg = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = Path(folder) / name
        if p.exists():
            cfg = {**json.loads(p.read_text(encoding="utf-8")), **cfg}
    out = {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None:
            out[k] = v
    return out


_ENV = None


def _environment():
    global _ENV
    if _ENV is None:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


def render(messages: list[dict], template: str | None = None, *, add_generation_prompt: bool = False,
           specials: dict | None = None, **kwargs) -> str:
    """The chat-formatted string of ``messages`` (``[{"role", "content"}]``)."""
    t = _environment().from_string(template or CHATML)
    return t.render(messages=messages, add_generation_prompt=add_generation_prompt, **(specials or {}), **kwargs)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of an already formatted string, no special tokens added."""
    inner = getattr(tokenizer, "tok", None)
    if inner is not None and hasattr(inner, "encode"):  # vidax.text.tokenizer.HFTokenizer
        inner.no_truncation()
        inner.no_padding()
        return list(inner.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text))  # the presets' WordTokenizer


def token_id(tokenizer, token: str) -> int | None:
    """The id of a special token (None if the vocabulary lacks it)."""
    inner = getattr(tokenizer, "tok", tokenizer)
    if hasattr(inner, "token_to_id"):
        return inner.token_to_id(token)
    return None


def pad(seqs: list[list[int]], length: int, pad_id: int, side: str = "right") -> np.ndarray:
    """int32 [B, length]; sequences longer than ``length`` are an error (never a silent cut)."""
    out = np.full((len(seqs), length), pad_id, np.int32)
    for b, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"{len(s)} tokens do not fit {length}")
        if side == "right":
            out[b, :len(s)] = s
        else:
            out[b, length - len(s):] = s
    return out
