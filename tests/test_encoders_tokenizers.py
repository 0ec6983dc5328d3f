"""Tokenizers the LM / CLIP / ByT5 encoders need, against transformers' own loading of the same
folders (ids and masks, left and right padding, truncation, special tokens), and ByT5 end to end:
its tokenizer's ids through the T5 encoder with every layer's hidden states."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.refutil import assert_parity, perturb  # noqa: E402
from vidax.compat import load_pretrained  # noqa: E402
from vidax.text import byt5  # noqa: E402
from vidax.text.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402

PROMPTS = ["A cat walks on the grass, realistic style.", "Two dogs  play\tin the snow; \"café\" 42!",
           "", "the the the  the", "Émile's 3 wolves aren't here, they'll come?"]
CORPUS = PROMPTS * 3 + ["a quick brown fox jumps over the lazy dog " * 3, "snow grass cat dog walks play realistic"]


def _ref_ids(tok, prompts, max_length, **kw):
    out = tok(prompts, padding="max_length", max_length=max_length, truncation=True, **kw)
    return np.asarray(out["input_ids"]), np.asarray(out["attention_mask"])


# ------------------------------------------------------------------------------------------ ByT5
GLYPH = ["<color-0>", "<color-1>", "<font-3>"]


def _byt5_folder(tmp_path):
    ref = transformers.ByT5Tokenizer()
    ref.add_tokens(GLYPH[:2])
    ref.add_tokens([GLYPH[2]], special_tokens=True)
    ref.save_pretrained(tmp_path)
    return transformers.AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("added", [False, True])
def test_byt5_tokenizer_matches_transformers(tmp_path, added):
    if added:
        ref = _byt5_folder(tmp_path)
        ours = load_tokenizer(tmp_path)
        assert isinstance(ours, byt5.ByT5Tokenizer) and ours.vocab_size == len(ref)
    else:
        ref, ours = transformers.ByT5Tokenizer(), byt5.ByT5Tokenizer()
    texts = PROMPTS + ['Text "<color-0>HELLO<font-3>" in  red </s> tail', "x <pad> y <unk>z <extra_id_7>é",
                       "<color-1><color-0>", "ends with eos</s>", "漢字 and emoji 🎬"]
    for t in texts:
        assert ours.encode(t) + ([] if ours.encode(t)[-1:] == [1] else [1]) == ref(t)["input_ids"], t
    for L in (8, 40):
        ids, mask = ours(texts, L)
        rids, rmask = _ref_ids(ref, texts, L)
        np.testing.assert_array_equal(ids, rids)
        np.testing.assert_array_equal(mask, rmask)
    ids, mask = ours(texts, 40, padding_side="left")
    rids, rmask = _ref_ids(ref, texts, 40, padding_side="left")
    np.testing.assert_array_equal(ids, rids)
    np.testing.assert_array_equal(mask, rmask)
    assert ours.count(texts) == [len(ref(t)["input_ids"]) for t in texts]
    assert ours.decode(ours.encode("café <color-0>" if added else "café")) == ("café <color-0>" if added else "café")


def test_byt5_encoder_end_to_end(tmp_path):
    """Glyph-ByT5 shape: a T5 encoder with the vocabulary grown by the added tokens, fed by the
    ByT5 tokenizer, through ``load_pretrained`` with every layer's hidden states."""
    ref_tok = _byt5_folder(tmp_path / "tok")
    cfg = transformers.T5Config(vocab_size=len(ref_tok), d_model=48, d_kv=12, d_ff=64, num_layers=3, num_heads=4,
                                feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                relative_attention_max_distance=20)
    torch.manual_seed(0)
    model = perturb(transformers.T5EncoderModel(cfg), seed=6)
    model.save_pretrained(tmp_path / "enc")
    texts = ['"<color-1>SALE<font-3>"', "a much longer glyph text with <color-0>colour"]
    ids, mask = load_tokenizer(tmp_path / "tok")(texts, 24)
    rids, rmask = _ref_ids(ref_tok, texts, 24)
    np.testing.assert_array_equal(ids, rids)
    cm = load_pretrained(tmp_path / "enc")
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(rids), attention_mask=torch.from_numpy(rmask), output_hidden_states=True)
    out = cm(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == 4
    for i, (a, b) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        assert_parity(a, b.numpy(), what=f"ByT5 hidden_states[{i}]")
    assert_parity(cm.forward(input_ids=ids, attention_mask=mask), ref.last_hidden_state.numpy(), what="ByT5 last")
    assert byt5.load_byt5(tmp_path / "enc").cfg.vocab_size == len(ref_tok)


# ------------------------------------------------------------------------------------------ BPE tokenizers
def _bytelevel_bpe(regex: str | None, special: list[str], nfc: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)]
    if regex is not None:
        pre = [pre_tokenizers.Split(Regex(regex), behavior="isolated")] + pre
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


QWEN_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
              r"""\s+(?!\S)|\s+""")


def _save(tok, folder, tokenizer_class, **special):
    from tokenizers import processors

    if special.pop("template_bos", False):
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in special.items()
                                                                         if k.endswith("_token")})
    fast.save_pretrained(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = tokenizer_class
    cfg.update({k: v for k, v in special.items() if not k.endswith("_token")})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return transformers.AutoTokenizer.from_pretrained(folder)


def _gemma_like():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=[
        "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"] + bytes_))
    return tok


def _clip_like():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
                                   r"""[^\s\p{L}\p{N}]+"""), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, end_of_word_suffix="</w>",
                                                        special_tokens=["<|startoftext|>", "<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


# name -> (builder of (tokenizers.Tokenizer), tokenizer_class, special tokens / config)
BPE_CASES = {
    # Llama 3 style: byte-level BPE, a <|begin_of_text|> template in the file, class PreTrainedTokenizerFast
    "llama3": (lambda: _bytelevel_bpe(None, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]),
               "PreTrainedTokenizerFast", dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                                               pad_token="<|end_of_text|>", template_bos=True)),
    "qwen2": (lambda: _bytelevel_bpe(QWEN_REGEX, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], nfc=True),
              "Qwen2Tokenizer", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")),
    "gemma3": (_gemma_like, "GemmaTokenizer", dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                                   unk_token="<unk>", add_bos_token=True, add_eos_token=False)),
    "clip": (_clip_like, "CLIPTokenizer", dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>", unk_token="<|endoftext|>")),
}


@pytest.mark.parametrize("name", list(BPE_CASES))
def test_bpe_tokenizers_match_transformers(name, tmp_path):
    build, cls, special = BPE_CASES[name]
    ref = _save(build(), tmp_path, cls, **dict(special))
    ours = load_tokenizer(tmp_path)
    assert isinstance(ours, HFTokenizer)
    texts = PROMPTS + ["<|im_start|>user\nDescribe the video<|im_end|>" if name == "qwen2" else "with a\nnewline"]
    assert ours.padding_side == ref.padding_side
    for L in (6, 24):
        ids, mask = ours(texts, L)
        rids, rmask = _ref_ids(ref, texts, L)
        np.testing.assert_array_equal(ids, rids, err_msg=f"{name} max_length={L}")
        np.testing.assert_array_equal(mask, rmask)
    for side in ("left", "right"):
        ids, mask = ours(texts, 24, padding_side=side)
        rids, rmask = _ref_ids(ref, texts, 24, padding_side=side)
        np.testing.assert_array_equal(ids, rids, err_msg=f"{name} {side}")
        np.testing.assert_array_equal(mask, rmask)
    ids, _ = ours(texts, 24, add_special_tokens=False)
    rids, _ = _ref_ids(ref, texts, 24, add_special_tokens=False)
    np.testing.assert_array_equal(ids, rids)
    for t in texts:
        assert ours.encode(t) == ref(t)["input_ids"]
    assert ours.count(texts) == [len(ref(t)["input_ids"]) for t in texts]
    assert ours.eos_id == ref.eos_token_id and ours.pad_id == ref.pad_token_id
    if ref.bos_token_id is not None:
        assert ours.bos_id == ref.bos_token_id


def test_template_prefix_length(tmp_path):
    """``crop_start`` of a chat template: the prefix's tokens are exactly the first tokens of every
    templated prompt, so cropping them leaves the prompt's own tokens."""
    from vidax.text.lm import prefix_length

    build, cls, special = BPE_CASES["llama3"]
    _save(build(), tmp_path, cls, **dict(special))
    tok = load_tokenizer(tmp_path)
    template = "<|begin_of_text|>system\nDescribe the video in detail:<|eot_id|>user\n{}<|eot_id|>"
    n = prefix_length(tok, template)
    for p in PROMPTS:
        full = tok.encode(template.format(p))
        assert full[:n] == tok.encode(template.split("{}")[0])
    ids, mask = tok([template.format(p) for p in PROMPTS], n + 16)
    assert mask[:, :n].all()
    with pytest.raises(ValueError):
        prefix_length(tok, "no placeholder")
