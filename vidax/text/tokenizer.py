"""Prompt tokenizers with one calling convention::

    ids, mask = tok(prompts, max_length)     # int32 [B, max_length] each

Output matches transformers' ``tokenizer(prompts, padding="max_length", truncation=True,
max_length=max_length, add_special_tokens=True)``: T5 appends ``</s>``; a truncated prompt keeps
``max_length - 1`` tokens and still ends in ``</s>``; padding is on the right with the pad id.

- :class:`ByteTokenizer`: dependency-free byte-level tokenizer for the ``tiny`` preset;
- :func:`load_tokenizer`: a real tokenizer from a checkpoint folder (``tokenizer.json`` through the
  ``tokenizers`` package, else ``spiece.model`` through ``sentencepiece``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

# transformers (>= 5) rebuilds every T5-class tokenizer from the vocabulary in tokenizer.json with
# a fixed pipeline, whatever else the file says; we do the same so the ids agree.
_T5_CLASSES = {"T5Tokenizer", "T5TokenizerFast", "UMT5Tokenizer", "UMT5TokenizerFast"}


def _as_list(prompts) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    return [str(p) for p in prompts]


def _pack(seqs: Sequence[Sequence[int]], max_length: int, pad_id: int):
    ids = np.full((len(seqs), max_length), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), max_length), dtype=np.int32)
    for b, s in enumerate(seqs):
        n = min(len(s), max_length)
        ids[b, :n] = s[:n]
        mask[b, :n] = 1
    return ids, mask


class ByteTokenizer:
    """Byte-level tokenizer: id = utf-8 byte + 3; 0 = pad, 1 = eos (appended), 2 = unk (unused)."""

    pad_id, eos_id, unk_id, offset = 0, 1, 2, 3
    vocab_size = 256 + 3

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def __call__(self, prompts, max_length: int):
        if max_length < 1:
            raise ValueError("max_length must be >= 1")
        seqs = [self.encode(p)[: max_length - 1] + [self.eos_id] for p in _as_list(prompts)]
        return _pack(seqs, max_length, self.pad_id)

    def count(self, prompts) -> list[int]:
        """Tokens per prompt, special tokens included, before any truncation."""
        return [len(self.encode(p)) + 1 for p in _as_list(prompts)]

    def decode(self, ids) -> str:
        return bytes(int(i) - self.offset for i in ids if int(i) >= self.offset).decode("utf-8", "replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (from ``tokenizer.json``) behind the common call signature.

    ``tok(prompts, max_length, padding_side=None, add_special_tokens=True) -> (ids, mask)``: padded
    to ``max_length`` on ``padding_side`` (default: the tokenizer's own, ``tokenizer_config.json``'s
    ``padding_side`` or the class default — Gemma pads on the left), truncated on the right like
    transformers' ``padding="max_length", truncation=True``."""

    def __init__(self, tokenizer, pad_id: int, pad_token: str, padding_side: str = "right",
                 bos_id: int | None = None, eos_id: int | None = None, truncation_side: str = "right"):
        self.tok, self.pad_id, self.pad_token = tokenizer, int(pad_id), pad_token
        self.padding_side, self.truncation_side = padding_side, truncation_side
        self.bos_id, self.eos_id = bos_id, eos_id

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def count(self, prompts, add_special_tokens: bool = True) -> list[int]:
        """Tokens per prompt, special tokens included, before any truncation."""
        self.tok.no_truncation()
        self.tok.no_padding()
        return [len(e.ids) for e in self.tok.encode_batch(_as_list(prompts), add_special_tokens=add_special_tokens)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text, no padding or truncation (e.g. a template prefix, for ``crop_start``)."""
        self.tok.no_truncation()
        self.tok.no_padding()
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __call__(self, prompts, max_length: int, padding_side: str | None = None, add_special_tokens: bool = True):
        side = padding_side or self.padding_side
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
        self.tok.enable_truncation(max_length=max_length, strategy="longest_first", direction=self.truncation_side)
        self.tok.enable_padding(direction=side, pad_id=self.pad_id, pad_token=self.pad_token, length=max_length)
        enc = self.tok.encode_batch(_as_list(prompts), add_special_tokens=add_special_tokens)
        ids = np.asarray([e.ids for e in enc], dtype=np.int32).reshape(-1, max_length)
        mask = np.asarray([e.attention_mask for e in enc], dtype=np.int32).reshape(-1, max_length)
        return ids, mask


class SentencePieceTokenizer:
    """A ``spiece.model`` behind the common call signature (T5 convention: ``</s>`` appended)."""

    def __init__(self, path: str | Path, pad_id: int | None = None, eos_id: int | None = None):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.eos_id = int(eos_id if eos_id is not None else self._id("</s>", self.sp.eos_id()))
        self.pad_id = int(pad_id if pad_id is not None else self._id("<pad>", self.sp.pad_id()))
        if self.eos_id < 0:
            raise ValueError(f"{path}: sentencepiece model has no </s> token")
        if self.pad_id < 0:
            self.pad_id = 0

    def _id(self, piece: str, fallback: int) -> int:
        i = self.sp.piece_to_id(piece)
        return i if (i != self.sp.unk_id() or piece == "<unk>") else fallback

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def count(self, prompts) -> list[int]:
        """Tokens per prompt, special tokens included, before any truncation."""
        return [len(t) + 1 for t in self.sp.encode([" ".join(p.split()) for p in _as_list(prompts)], out_type=int)]

    def __call__(self, prompts, max_length: int):
        if max_length < 1:
            raise ValueError("max_length must be >= 1")
        # whitespace split first, like the transformers T5 pipeline (WhitespaceSplit pre-tokenizer):
        # tabs / newlines separate words even where the model's normaliser would not map them
        texts = [" ".join(p.split()) for p in _as_list(prompts)]
        toks = self.sp.encode(texts, out_type=int)
        seqs = [list(t)[: max_length - 1] + [self.eos_id] for t in toks]
        return _pack(seqs, max_length, self.pad_id)


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}


def _token_str(t) -> str | None:
    if t is None:
        return None
    return t["content"] if isinstance(t, dict) else str(t)


def load_tokenizer(folder: str | Path):
    """Tokenizer from a checkpoint folder (``tokenizer.json`` preferred, else ``spiece.model``).

    A folder that holds a ``tokenizer/`` sub-folder (diffusers layout) is accepted too. A ByT5
    folder (``tokenizer_class`` ByT5Tokenizer, no vocabulary file) gives a
    :class:`vidax.text.byt5.ByT5Tokenizer`."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists() and not (folder / "spiece.model").exists() and (folder / "tokenizer").is_dir():
        folder = folder / "tokenizer"
    cfg = _read_json(folder / "tokenizer_config.json")
    special = _read_json(folder / "special_tokens_map.json")
    pad_token = _token_str(cfg.get("pad_token") or special.get("pad_token")) or "<pad>"
    eos_token = _token_str(cfg.get("eos_token") or special.get("eos_token")) or "</s>"
    tok_class = cfg.get("tokenizer_class")
    if tok_class == "ByT5Tokenizer" and not (folder / "tokenizer.json").exists():
        from vidax.text.byt5 import ByT5Tokenizer

        return ByT5Tokenizer.from_folder(folder)

    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        j = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        is_t5 = tok_class in _T5_CLASSES or (tok_class is None and j.get("model", {}).get("type") == "Unigram"
                                             and j.get("post_processor") is None)
        if is_t5:
            j = _t5_pipeline(j, eos_token)
        j["truncation"] = None
        j["padding"] = None
        if not is_t5:
            j = _post_processor(j, cfg, tok_class, special)
        tok = Tokenizer.from_str(json.dumps(j))
        pad_id = tok.token_to_id(pad_token)
        if pad_id is None:
            pad_id = 0
        bos, eos = _token_str(cfg.get("bos_token") or special.get("bos_token")), eos_token
        side = cfg.get("padding_side") or ("left" if str(tok_class or "").startswith("Gemma") else "right")
        return HFTokenizer(tok, pad_id, pad_token, padding_side=side,
                           bos_id=None if bos is None else tok.token_to_id(bos), eos_id=tok.token_to_id(eos),
                           truncation_side=cfg.get("truncation_side") or "right")

    if (folder / "spiece.model").exists():
        return SentencePieceTokenizer(folder / "spiece.model")
    raise FileNotFoundError(f"{folder}: no tokenizer.json or spiece.model")


def _post_processor(j: dict, cfg: dict, tok_class: str | None, special: dict) -> dict:
    """The post-processor transformers (>= 5) ends up with: CLIP always gets ``<bos> $A <eos>``
    (RobertaProcessing); a config that states ``add_bos_token`` / ``add_eos_token`` (Gemma, Llama)
    gets a template with exactly those; otherwise the file's own (none: nothing added)."""
    j = dict(j)
    ids = {t["content"]: t["id"] for t in j.get("added_tokens", [])}
    vocab = j.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        ids = {**vocab, **ids}

    def tid(name):
        t = _token_str(cfg.get(name) or special.get(name))
        if t is None or t not in ids:
            return None, None
        return t, ids[t]

    cls = str(tok_class or "").removesuffix("Fast")
    if cls == "CLIPTokenizer":
        (bos, bi), (eos, ei) = tid("bos_token"), tid("eos_token")
        if bos is not None and eos is not None:
            j["post_processor"] = {"type": "RobertaProcessing", "sep": [eos, ei], "cls": [bos, bi],
                                   "trim_offsets": False, "add_prefix_space": False}
        return j
    if "add_bos_token" in cfg or "add_eos_token" in cfg or j.get("post_processor") is None:
        add_bos, add_eos = bool(cfg.get("add_bos_token", False)), bool(cfg.get("add_eos_token", False))
        (bos, bi), (eos, ei) = tid("bos_token"), tid("eos_token")
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        if not (add_bos or add_eos) and j.get("post_processor") is None:
            return j
        seq = lambda k: {"Sequence": {"id": k, "type_id": 0 if k == "A" else 1}}  # noqa: E731
        sp = lambda t, k: {"SpecialToken": {"id": t, "type_id": k}}  # noqa: E731
        single = ([sp(bos, 0)] if add_bos else []) + [seq("A")] + ([sp(eos, 0)] if add_eos else [])
        pair = single + ([sp(bos, 1)] if add_bos else []) + [seq("B")] + ([sp(eos, 1)] if add_eos else [])
        toks = {t: {"id": t, "ids": [i], "tokens": [t]} for t, i, on in ((bos, bi, add_bos), (eos, ei, add_eos)) if on}
        j["post_processor"] = {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": toks}
    return j


def _t5_pipeline(j: dict, eos_token: str) -> dict:
    """The pipeline transformers' T5 tokenizer imposes: the file's Unigram vocabulary; only the
    sentencepiece ``Precompiled`` normalizer (if any); whitespace split + Metaspace; ``$A </s>``."""
    j = dict(j)
    norm = j.get("normalizer")
    items = norm.get("normalizers", []) if isinstance(norm, dict) and norm.get("type") == "Sequence" else [norm]
    pre = [n for n in items if isinstance(n, dict) and n.get("type") == "Precompiled" and n.get("precompiled_charsmap")]
    j["normalizer"] = pre[0] if pre else None
    j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
    ]}
    eos_id = None
    vocab = j.get("model", {}).get("vocab")
    for t in j.get("added_tokens", []):
        if t.get("content") == eos_token:
            eos_id = t["id"]
    if eos_id is None and isinstance(vocab, list):
        eos_id = next((i for i, v in enumerate(vocab) if v[0] == eos_token), None)
    if eos_id is None:
        raise ValueError(f"T5 tokenizer has no eos token {eos_token!r}")
    j["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eos_token, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eos_token, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 0}}, {"SpecialToken": {"id": eos_token, "type_id": 0}}],
        "special_tokens": {eos_token: {"id": eos_token, "ids": [eos_id], "tokens": [eos_token]}},
    }
    return j


__all__ = ["ByteTokenizer", "HFTokenizer", "SentencePieceTokenizer", "load_tokenizer"]
