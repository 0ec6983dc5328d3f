"""ByT5: the T5 encoder (:mod:`vidax.text.t5`, ``T5EncoderModel``) over utf-8 bytes.

HunyuanVideo 1.5 encodes quoted glyph text with a ByT5-small encoder (Glyph-ByT5) whose tokenizer
has extra colour / font tokens added. The encoder needs nothing new — ``t5.load_t5(folder)`` /
``load_pretrained`` read it (``feed_forward_proj="gated-gelu"``, the vocabulary resized for the
added tokens) — so this module is the tokenizer, reproducing transformers' ``ByT5Tokenizer``:

- ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, byte ``b`` -> ``b + 3``; ``<extra_id_k>`` and any added
  tokens at the ids the folder's ``tokenizer_config.json`` (``added_tokens_decoder``) or
  ``added_tokens.json`` gives them (by default ``<extra_id_0..124>`` are 259..383);
- added / special tokens in the text are matched first (leftmost, longest), as whole tokens; a
  token flagged ``lstrip`` / ``rstrip`` (``<pad>``, ``</s>``, ``<unk>`` are) eats the whitespace
  beside it;
- ``</s>`` is appended unless the ids already end with it; truncation keeps ``max_length - 1`` ids
  and then appends it; padding with ``<pad>`` on the right (or left).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from vidax.text import t5
from vidax.text.tokenizer import _as_list

load_byt5 = t5.load_t5  # the encoder: a T5 encoder stack


class ByT5Tokenizer:
    pad_id, eos_id, unk_id, offset = 0, 1, 2, 3

    def __init__(self, added: dict[str, int] | None = None, strip: dict[str, tuple[bool, bool]] | None = None,
                 extra_ids: int = 125, padding_side: str = "right"):
        """``added``: token -> id beyond the bytes (default: ``<extra_id_k>`` at 259 + k);
        ``strip``: token -> (lstrip, rstrip) (default: the three special tokens strip both sides)."""
        base = {"<pad>": 0, "</s>": 1, "<unk>": 2}
        if added is None:
            added = {f"<extra_id_{k}>": 256 + self.offset + k for k in range(extra_ids)}
        self.added = {**base, **added}
        self.strip = {t: (True, True) for t in base}
        self.strip.update(strip or {})
        self.padding_side = padding_side
        toks = sorted(self.added, key=len, reverse=True)  # alternation tries longer tokens first
        self._split = re.compile("(" + "|".join(re.escape(t) for t in toks) + ")") if toks else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ByT5Tokenizer":
        """From a saved tokenizer folder (``tokenizer_config.json`` with ``added_tokens_decoder``,
        or ``added_tokens.json``); a diffusers pipeline's ``tokenizer_2/`` is found."""
        folder = Path(folder)
        if not (folder / "tokenizer_config.json").exists() and (folder / "tokenizer_2" / "tokenizer_config.json").exists():
            folder = folder / "tokenizer_2"
        cfg = json.loads((folder / "tokenizer_config.json").read_text()) if (folder / "tokenizer_config.json").exists() else {}
        side = cfg.get("padding_side") or "right"
        dec = cfg.get("added_tokens_decoder")
        if dec:
            added = {v["content"]: int(k) for k, v in dec.items()}
            strip = {v["content"]: (bool(v.get("lstrip")), bool(v.get("rstrip"))) for v in dec.values()}
            return cls(added, strip, padding_side=side)
        if (folder / "added_tokens.json").exists():
            extra = {str(k): int(v) for k, v in json.loads((folder / "added_tokens.json").read_text()).items()}
            return cls({**{f"<extra_id_{k}>": 259 + k for k in range(int(cfg.get("extra_ids", 125)))}, **extra},
                       padding_side=side)
        return cls(extra_ids=int(cfg.get("extra_ids", 125)), padding_side=side)

    @property
    def vocab_size(self) -> int:
        return max(max(self.added.values()) + 1, 256 + self.offset)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        parts = self._split.split(text) if self._split is not None else [text]
        # parts alternate text, token, text, ...: apply the tokens' whitespace stripping
        for i in range(1, len(parts), 2):
            lstrip, rstrip = self.strip.get(parts[i], (False, False))
            if lstrip:
                parts[i - 1] = parts[i - 1].rstrip()
            if rstrip:
                parts[i + 1] = parts[i + 1].lstrip()
        ids: list[int] = []
        for i, p in enumerate(parts):
            if i % 2:
                ids.append(self.added[p])
            else:
                ids.extend(b + self.offset for b in p.encode("utf-8"))
        return ids

    def _with_eos(self, ids: list[int]) -> list[int]:
        return ids if ids and ids[-1] == self.eos_id else ids + [self.eos_id]

    def count(self, prompts, add_special_tokens: bool = True) -> list[int]:
        """Tokens per prompt (``</s>`` included), before any truncation."""
        return [len(self._with_eos(self.encode(p)) if add_special_tokens else self.encode(p)) for p in _as_list(prompts)]

    def __call__(self, prompts, max_length: int, padding_side: str | None = None, add_special_tokens: bool = True):
        if max_length < 1:
            raise ValueError("max_length must be >= 1")
        side = padding_side or self.padding_side
        seqs = []
        for p in _as_list(prompts):
            ids = self.encode(p)
            if add_special_tokens:
                if len(ids) + 1 > max_length:  # room for the one special token, as transformers counts it
                    ids = ids[: max_length - 1]
                ids = self._with_eos(ids)
            seqs.append(ids[:max_length])
        out = np.full((len(seqs), max_length), self.pad_id, np.int32)
        mask = np.zeros((len(seqs), max_length), np.int32)
        for b, s in enumerate(seqs):
            sl = slice(0, len(s)) if side == "right" else slice(max_length - len(s), max_length)
            out[b, sl], mask[b, sl] = s, 1
        return out, mask

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        inv = {v: k for k, v in self.added.items()}
        out = b""
        for i in (int(i) for i in ids):
            if i in inv:
                if not (skip_special_tokens and i in (0, 1, 2)):
                    out += inv[i].encode("utf-8")
            elif self.offset <= i < 256 + self.offset:
                out += bytes([i - self.offset])
        return out.decode("utf-8", errors="ignore")


__all__ = ["ByT5Tokenizer", "load_byt5"]
