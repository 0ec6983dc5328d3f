"""T5 / UMT5 text encoder and tokenizers: parity against transformers, Wan's original naming,
checkpoint mismatch errors, tokenizer equivalence."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.refutil import assert_parity, perturb  # noqa: E402
from vidax.compat import load_pretrained  # noqa: E402
from vidax.core.jit import CompileCounter  # noqa: E402
from vidax.text import t5  # noqa: E402
from vidax.text.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from vidax.weights import CheckpointMismatchError, open_checkpoint, save_safetensors  # noqa: E402

VOCAB = 300

# (name, reference config class, model class, config kwargs, sequence length)
CASES = {
    # small bucket settings so short sequences reach the logarithmic and the clamped buckets
    "t5_gated": ("T5Config", "T5EncoderModel", dict(feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
                                                    relative_attention_max_distance=20, num_layers=3), 37),
    "t5_relu": ("T5Config", "T5EncoderModel", dict(feed_forward_proj="relu", relative_attention_num_buckets=16,
                                                   relative_attention_max_distance=24, num_layers=2), 33),
    # real UMT5 bucket settings; L > 128 reaches the last bucket
    "umt5": ("UMT5Config", "UMT5EncoderModel", dict(feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                                                    relative_attention_max_distance=128, num_layers=3), 140),
}


def _ref_model(case, seed=0):
    cfg_cls, model_cls, kw, _ = CASES[case]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_heads=4, **kw)
    torch.manual_seed(seed)
    return perturb(getattr(transformers, model_cls)(cfg), seed=seed)


def _inputs(L, lengths=(None, 11, 4), seed=0):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    ids = rng.integers(2, VOCAB, (B, L)).astype(np.int64)
    mask = np.zeros((B, L), np.int64)
    for b, n in enumerate(lengths):
        n = L if n is None else n
        mask[b, :n] = 1
        ids[b, n:] = 0  # pad id, as a tokenizer would write
        if n:
            ids[b, n - 1] = 1  # eos
    return ids, mask


def _ref_out(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=None if mask is None else torch.from_numpy(mask),
                    return_dict=False)
    return out[0].numpy()


# ------------------------------------------------------------------------------------------ config
def test_config_from_hf_defaults_and_variants():
    c = t5.T5Config.from_hf(transformers.T5Config().to_dict())
    assert (c.vocab_size, c.d_model, c.num_layers, c.feed_forward_proj, c.per_layer_rel_bias) == (32128, 512, 6, "relu", False)
    assert not c.is_gated and c.act_name == "relu"
    u = t5.T5Config.from_hf(transformers.UMT5Config().to_dict())
    assert (u.vocab_size, u.d_ff, u.num_heads, u.per_layer_rel_bias) == (250112, 1024, 6, True)
    assert u.is_gated and u.act_name == "gelu_new"
    # minimal dicts fall back to the per-model defaults; aliases are understood
    m = t5.T5Config.from_hf({"model_type": "umt5", "hidden_size": 32, "num_hidden_layers": 2})
    assert (m.d_model, m.num_layers, m.feed_forward_proj, m.per_layer_rel_bias) == (32, 2, "gated-gelu", True)
    assert t5.T5Config.from_hf({"architectures": ["UMT5EncoderModel"]}).per_layer_rel_bias
    s = t5.T5Config.from_hf({"feed_forward_proj": "gated-silu"})
    assert s.is_gated and s.act_name == "silu"
    with pytest.raises(ValueError):
        t5.T5Config(feed_forward_proj="swiglu-gated")
    hash(u)  # static jit argument


def test_relative_position_buckets_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    for nb, md in [(32, 128), (8, 20), (16, 24), (32, 64), (64, 256), (6, 9)]:
        L = 300
        ours = t5.relative_position_buckets(L, L, nb, md)
        rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]
        ref = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=nb, max_distance=md).numpy()
        np.testing.assert_array_equal(ours, ref, err_msg=f"buckets={nb} max_distance={md}")
        assert ours.min() >= 0 and ours.max() < nb


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("case", list(CASES))
def test_parity_vs_transformers(case, tmp_path):
    model = _ref_model(case)
    L = CASES[case][3]
    ids, mask = _inputs(L)
    kw = {"max_shard_size": "40KB"} if case == "umt5" else {}
    model.save_pretrained(tmp_path, **kw)
    if kw:
        assert list(tmp_path.glob("*.safetensors.index.json")), "sharded save expected"
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    cm = load_pretrained(tmp_path)
    assert isinstance(cm.model_config, t5.T5Config)
    out = cm.forward(input_ids=ids, attention_mask=mask)
    assert out.dtype == np.float32
    assert_parity(out, _ref_out(model, ids, mask), what=f"{case} padded")
    # no mask at all
    out = cm.forward(input_ids=ids[:2])
    assert_parity(out, _ref_out(model, ids[:2], None), what=f"{case} unmasked")
    # inputs_embeds instead of ids
    emb = np.random.default_rng(1).standard_normal((2, 9, 64)).astype(np.float32)
    m2 = mask[1:, :9]
    with torch.no_grad():
        ref = model(inputs_embeds=torch.from_numpy(emb), attention_mask=torch.from_numpy(m2), return_dict=False)[0]
    assert_parity(cm.forward(inputs_embeds=emb, attention_mask=m2), ref.numpy(), what=f"{case} inputs_embeds")


def test_padding_does_not_leak_into_real_tokens():
    cfg = t5.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj="gated-gelu", per_layer_rel_bias=True)
    enc = t5.init(cfg, seed=1)
    ids, mask = _inputs(24, lengths=(9,), seed=3)
    long = np.asarray(enc(ids, mask))
    short = np.asarray(enc(ids[:, :9], mask[:, :9]))
    np.testing.assert_allclose(long[:, :9], short, atol=1e-5, rtol=1e-5)
    # garbage in the padded slots must not matter either
    ids2 = ids.copy()
    ids2[:, 9:] = 77
    np.testing.assert_allclose(np.asarray(enc(ids2, mask))[:, :9], short, atol=1e-5, rtol=1e-5)


def test_init_and_jit_reuse():
    for proj, per_layer in [("gated-gelu", True), ("relu", False)]:
        cfg = t5.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, relative_attention_max_distance=16,
                          feed_forward_proj=proj, per_layer_rel_bias=per_layer)
        enc = t5.init(cfg, seed=0)
        params = nnx.to_pure_dict(enc.state)
        shapes = t5.param_shapes(cfg)
        assert jax.tree.structure(params) == jax.tree.structure(shapes)
        for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shapes)):
            assert a.shape == s.shape and a.dtype == np.float32
            assert np.all(a != 0) and not np.all(a == 1)
        ids, mask = _inputs(10, lengths=(None, 3), seed=0)
        ids = ids % 64
        out = enc(ids, mask)
        assert out.shape == (2, 10, 16) and out.dtype == np.float32 and np.isfinite(np.asarray(out)).all()
        enc2 = t5.init(dataclasses.replace(cfg), seed=0)
        with CompileCounter() as cc:
            enc2((ids + 1) % 64, mask)
        assert cc.count == 0, "same shapes + equal config must hit the jit cache"


def test_bf16_params_compute_in_fp32(tmp_path):
    model = _ref_model("umt5")
    model.save_pretrained(tmp_path)
    enc = t5.load_t5(tmp_path, dtype=ml_dtypes.bfloat16)
    assert enc.state["blocks"]["q"]["kernel"].dtype == ml_dtypes.bfloat16
    ids, mask = _inputs(20)
    out = np.asarray(enc(ids, mask))
    assert out.dtype == np.float32
    # the reference with bf16-rounded weights, computed in fp32
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert_parity(out, _ref_out(model, ids, mask), what="bf16 storage")


# ------------------------------------------------------------------------------------------ Wan naming
# Transcribed from the public Wan2.1 repository, wan/modules/t5.py (T5Encoder as built by
# umt5_xxl(encoder_only=True), shared_pos=False), i.e. the state dict of
# models_t5_umt5-xxl-enc-bf16.pth, for 2 layers:
#   T5Encoder: token_embedding (nn.Embedding), blocks (ModuleList of T5SelfAttention), norm (T5LayerNorm)
#   T5SelfAttention: norm1, attn (T5Attention: q, k, v, o Linear bias=False), norm2,
#                    ffn (T5FeedForward: gate = Sequential(Linear, GELU), fc1, fc2), pos_embedding
#                    (T5RelativeEmbedding: embedding = nn.Embedding(num_buckets, num_heads))
#   T5FeedForward.forward: fc2(fc1(x) * gate(x))
WAN_NAMES_2_LAYERS = {"token_embedding.weight", "norm.weight"} | {
    f"blocks.{i}.{n}" for i in range(2) for n in [
        "norm1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "norm2.weight",
        "ffn.gate.0.weight", "ffn.fc1.weight", "ffn.fc2.weight", "pos_embedding.embedding.weight",
    ]
}


class _WanStyleEncoder(torch.nn.Module):
    """Independent torch model with Wan's module tree (names) and forward semantics, used as a
    second reference for the original-release naming."""

    class _Norm(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(d))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    class _Attn(torch.nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

        def forward(self, x, mask, bias):
            B, L, D = x.shape
            split = lambda t: t.view(B, L, self.h, D // self.h).transpose(1, 2)  # noqa: E731
            s = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) + bias
            s = s.masked_fill(mask[:, None, None, :] == 0, torch.finfo(s.dtype).min)
            return self.o((s.softmax(-1) @ split(self.v(x))).transpose(1, 2).reshape(B, L, D))

    class _FFN(torch.nn.Module):
        def __init__(self, d, f):
            super().__init__()
            self.gate = torch.nn.Sequential(torch.nn.Linear(d, f, bias=False), torch.nn.GELU(approximate="tanh"))
            self.fc1 = torch.nn.Linear(d, f, bias=False)
            self.fc2 = torch.nn.Linear(f, d, bias=False)

        def forward(self, x):
            return self.fc2(self.fc1(x) * self.gate(x))

    class _RelEmb(torch.nn.Module):
        def __init__(self, nb, h):
            super().__init__()
            self.nb = nb
            self.embedding = torch.nn.Embedding(nb, h)

        def forward(self, L):
            from transformers.models.t5.modeling_t5 import T5Attention

            rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]
            b = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=self.nb, max_distance=128)
            return self.embedding(b).permute(2, 0, 1)[None]

    class _Block(torch.nn.Module):
        def __init__(self, d, f, h, nb):
            super().__init__()
            W = _WanStyleEncoder
            self.norm1, self.attn, self.norm2 = W._Norm(d), W._Attn(d, h), W._Norm(d)
            self.ffn, self.pos_embedding = W._FFN(d, f), W._RelEmb(nb, h)

        def forward(self, x, mask):
            x = x + self.attn(self.norm1(x), mask, self.pos_embedding(x.shape[1]))
            return x + self.ffn(self.norm2(x))

    def __init__(self, vocab, d, f, h, layers, nb):
        super().__init__()
        self.token_embedding = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([self._Block(d, f, h, nb) for _ in range(layers)])
        self.norm = self._Norm(d)

    def forward(self, ids, mask):
        x = self.token_embedding(ids)
        for b in self.blocks:
            x = b(x, mask)
        return self.norm(x)


def test_wan_keymap_names_match_wan_release():
    cfg = t5.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", per_layer_rel_bias=True)
    km = t5.wan_keymap(cfg)
    ours = {r.name(i) for r in km.rules for i in (range(2) if r.stacked else [None])}
    assert ours == WAN_NAMES_2_LAYERS
    ref = _WanStyleEncoder(VOCAB, 64, 96, 4, 2, 32)
    assert set(ref.state_dict()) == WAN_NAMES_2_LAYERS
    # transformers <-> Wan renaming through the two maps covers every tensor once
    hf_names = [f"encoder.block.{i}.layer.{n}" for i in range(2) for n in [
        "0.layer_norm.weight", "0.SelfAttention.q.weight", "0.SelfAttention.k.weight", "0.SelfAttention.v.weight",
        "0.SelfAttention.o.weight", "0.SelfAttention.relative_attention_bias.weight", "1.layer_norm.weight",
        "1.DenseReluDense.wi_0.weight", "1.DenseReluDense.wi_1.weight", "1.DenseReluDense.wo.weight"]]
    hf_names += ["shared.weight", "encoder.final_layer_norm.weight"]
    ren = t5.hf_keymap(cfg).rename(hf_names, km)
    assert set(ren.values()) == WAN_NAMES_2_LAYERS
    assert ren["encoder.block.1.layer.1.DenseReluDense.wi_0.weight"] == "blocks.1.ffn.gate.0.weight"
    assert ren["encoder.block.1.layer.1.DenseReluDense.wi_1.weight"] == "blocks.1.ffn.fc1.weight"


def test_wan_pth_vs_wan_style_reference(tmp_path):
    torch.manual_seed(0)
    ref = perturb(_WanStyleEncoder(VOCAB, 64, 96, 4, 2, 32), seed=5)
    path = tmp_path / "models_t5_umt5-tiny-enc.pth"
    torch.save(ref.state_dict(), path)
    enc = t5.load_t5(path)  # config inferred from the tensors
    assert enc.cfg.per_layer_rel_bias and enc.cfg.num_layers == 2 and enc.cfg.num_heads == 4
    ids, mask = _inputs(150, lengths=(150, 37, 6))
    with torch.no_grad():
        want = ref(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert_parity(np.asarray(enc(ids, mask)), want, what="wan-style reference")


def test_wan_pth_from_transformers_umt5(tmp_path):
    """UMT5 weights renamed to the Wan release names, stored as a bf16 .pth like the original file."""
    model = _ref_model("umt5", seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the release stores bf16
    cfg = t5.T5Config.from_hf(model.config.to_dict())
    sd = {k: v for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
    ren = t5.hf_keymap(cfg).rename(sd, t5.wan_keymap(cfg))
    wan_sd = {ren[k]: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}
    assert {n for n in wan_sd if not n.startswith("blocks.2.")} == WAN_NAMES_2_LAYERS
    path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save(wan_sd, path)
    ids, mask = _inputs(CASES["umt5"][3])
    ref = _ref_out(model, ids, mask)
    enc = t5.load_t5(path, cfg)
    assert t5.detect_naming(open_checkpoint(path)) == "wan"
    assert_parity(np.asarray(enc(ids, mask)), ref, what="wan .pth (cfg given)")
    enc2 = t5.load_t5(path)  # inferred config
    assert enc2.cfg == cfg
    assert_parity(np.asarray(enc2(ids, mask)), ref, what="wan .pth (cfg inferred)")


# ------------------------------------------------------------------------------------------ errors
def _np_state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}


def test_mismatched_checkpoints_raise(tmp_path):
    model = _ref_model("t5_relu")
    cfg = t5.T5Config.from_hf(model.config.to_dict())
    good = _np_state(model)
    t5.load_params_from(good, cfg, naming="hf")  # sanity

    key = "encoder.block.1.layer.0.SelfAttention.k.weight"
    missing = {k: v for k, v in good.items() if k != key}
    with pytest.raises(CheckpointMismatchError, match="missing.*" + key.replace(".", r"\.")):
        t5.load_params_from(missing, cfg, naming="hf")

    extra = dict(good, **{"encoder.block.0.layer.0.SelfAttention.q.bias": np.zeros(64, np.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"unexpected.*SelfAttention\.q\.bias"):
        t5.load_params_from(extra, cfg, naming="hf")

    # a layer beyond num_layers is unexpected too
    extra_layer = dict(good, **{"encoder.block.2.layer.0.layer_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"encoder\.block\.2\.layer\.0\.layer_norm\.weight"):
        t5.load_params_from(extra_layer, cfg, naming="hf")

    bad = dict(good)
    bad["encoder.block.0.layer.1.DenseReluDense.wo.weight"] = np.zeros((64, 95), np.float32)
    with pytest.raises(CheckpointMismatchError, match=r"mis-shaped.*DenseReluDense\.wo\.weight"):
        t5.load_params_from(bad, cfg, naming="hf")

    # wrong variant: a gated checkpoint for a relu config -> names the unexpected / missing tensors
    gated = _np_state(_ref_model("t5_gated"))
    gated = {k: v for k, v in gated.items() if not k.startswith("encoder.block.2.")}
    with pytest.raises(CheckpointMismatchError, match=r"DenseReluDense\.wi"):
        t5.load_params_from(gated, cfg, naming="hf")

    # through the compat loader from a folder on disk
    save_safetensors(missing, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(model.config.to_dict(), architectures=["T5EncoderModel"])))
    with pytest.raises(CheckpointMismatchError, match=key.replace(".", r"\.")):
        load_pretrained(tmp_path)


def test_embed_under_either_tied_name():
    model = _ref_model("t5_relu")
    cfg = t5.T5Config.from_hf(model.config.to_dict())
    sd = _np_state(model)
    a = t5.load_params_from(sd, cfg, naming="hf")
    alt = {("encoder.embed_tokens.weight" if k == "shared.weight" else k): v for k, v in sd.items()}
    b = t5.load_params_from(alt, cfg, naming="hf")
    np.testing.assert_array_equal(a["embed"]["embedding"], b["embed"]["embedding"])
    both = dict(sd, **{"encoder.embed_tokens.weight": sd["shared.weight"]})
    t5.load_params_from(both, cfg, naming="hf")
    # encoder half of a full encoder-decoder checkpoint: decoder / lm_head tensors ignored
    full = dict(sd, **{"decoder.block.0.layer.0.SelfAttention.q.weight": np.zeros((64, 64), np.float32),
                       "lm_head.weight": np.zeros((VOCAB, 64), np.float32)})
    t5.load_params_from(full, cfg, naming="hf")


# ------------------------------------------------------------------------------------------ tokenizers
PROMPTS = [
    "a photo of a cat sitting on a mat",
    "  The quick   brown fox\tjumps over\nthe lazy dog  ",
    "vidéo d'un chat",
    "猫が座っている",
    "",
    "a cat " * 40,  # truncated
    "Zebra QUICK 123 456, hello world!",
]


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids, mask = tok(["ab", "é", "x" * 20, ""], 6)
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == (4, 6)
    np.testing.assert_array_equal(ids[0], [ord("a") + 3, ord("b") + 3, 1, 0, 0, 0])
    np.testing.assert_array_equal(mask[0], [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(ids[1, :3], [0xC3 + 3, 0xA9 + 3, 1])
    np.testing.assert_array_equal(ids[2], [ord("x") + 3] * 5 + [1])  # truncated, still ends in eos
    assert mask[2].all()
    np.testing.assert_array_equal(ids[3], [1, 0, 0, 0, 0, 0])
    assert tok.decode(ids[1]) == "é"
    assert int(ids.max()) < tok.vocab_size
    ids1, _ = tok("ab", 6)
    np.testing.assert_array_equal(ids1, ids[:1])


def _train_tokenizer_json(folder, mangle=False):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = [p for p in PROMPTS if p] * 10 + ["dogs and cats and videos of foxes", "über naïve café"] * 10
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"],
                                                           unk_token="<unk>"))
    assert (tok.token_to_id("<pad>"), tok.token_to_id("</s>"), tok.token_to_id("<unk>")) == (0, 1, 2)
    ref = transformers.T5Tokenizer(tokenizer_object=tok, extra_ids=0)
    ref.save_pretrained(folder)
    if mangle:  # a tokenizer.json without post-processor and with extra normalisers
        j = json.loads((folder / "tokenizer.json").read_text())
        j["post_processor"] = None
        j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}
        (folder / "tokenizer.json").write_text(json.dumps(j))


@pytest.mark.parametrize("mangle", [False, True])
def test_tokenizer_json_matches_transformers(tmp_path, mangle):
    _train_tokenizer_json(tmp_path, mangle=mangle)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    for L in (8, 24, 64):
        want = ref(PROMPTS, padding="max_length", truncation=True, max_length=L, add_special_tokens=True)
        ids, mask = tok(PROMPTS, L)
        assert ids.dtype == np.int32 and mask.dtype == np.int32
        np.testing.assert_array_equal(ids, np.asarray(want["input_ids"]))
        np.testing.assert_array_equal(mask, np.asarray(want["attention_mask"]))
    assert (ids[:, :][mask.sum(1) < 64, :] == 0).any()  # some padding happened
    assert all(ids[b, mask[b].sum() - 1] == 1 for b in range(len(PROMPTS)))  # every row ends in </s>


def test_spiece_model_matches_transformers(tmp_path):
    import io

    import sentencepiece as spm

    corpus = [p for p in PROMPTS if p.strip()] * 10 + ["dogs and cats and videos of foxes"] * 10
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, vocab_size=80, model_type="unigram", pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, normalization_rule_name="identity", character_coverage=1.0, hard_vocab_limit=False,
        minloglevel=2)
    (tmp_path / "spiece.model").write_bytes(buf.getvalue())
    tok = load_tokenizer(tmp_path)
    # transformers builds T5 tokenizers from the sentencepiece vocabulary (converting the .model file
    # itself needs protobuf, which is not a dependency here): same pieces and scores, its own pipeline.
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "spiece.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    ref = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    for L in (8, 40):
        want = ref(PROMPTS, padding="max_length", truncation=True, max_length=L, add_special_tokens=True)
        ids, mask = tok(PROMPTS, L)
        np.testing.assert_array_equal(ids, np.asarray(want["input_ids"]))
        np.testing.assert_array_equal(mask, np.asarray(want["attention_mask"]))


def test_tokenizer_feeds_encoder(tmp_path):
    """End to end: real-tokenizer ids through the loaded encoder equal the transformers pipeline."""
    _train_tokenizer_json(tmp_path / "tok")
    model = _ref_model("umt5")
    model.save_pretrained(tmp_path / "enc")
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    want = ref_tok(PROMPTS[:3], padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        ref = model(**want).last_hidden_state.numpy()
    ids, mask = load_tokenizer(tmp_path / "tok")(PROMPTS[:3], 16)
    out = np.asarray(t5.load_t5(tmp_path / "enc")(ids, mask))
    assert_parity(out, ref, what="tokenizer + encoder")
    assert math.isfinite(float(np.abs(out).max()))


def test_parameters_carry_logical_axes():
    """Every parameter names its axes (the sharding rules' input); the stack leads with ``layers``."""
    cfg = t5.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", per_layer_rel_bias=True)
    enc = t5.abstract(cfg)
    params = {jax.tree_util.keystr(p): v for p, v in
              jax.tree_util.tree_leaves_with_path(enc.state, is_leaf=lambda x: isinstance(x, nnx.Variable))}
    axes = {k: v.get_metadata()["out_sharding"] for k, v in params.items()}
    for k, v in params.items():
        assert len(axes[k]) == len(v.shape), k
    assert axes["['embed']['embedding']"] == ("vocab", "embed")
    assert axes["['blocks']['q']['kernel']"] == ("layers", "embed", "heads")
    assert axes["['blocks']['o']['kernel']"] == ("layers", "heads", "embed")
    assert axes["['blocks']['wi_0']['kernel']"] == ("layers", "embed", "ffn")
    assert axes["['blocks']['wo']['kernel']"] == ("layers", "ffn", "embed")
    assert axes["['blocks']['rel_bias']['embedding']"] == ("layers", None, "heads")


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_load_matches_transformers(tp, tmp_path):
    """``load_t5(folder, mesh="tp=N")`` (how real checkpoints' encoders are split over the encode
    slice): each device holds its shard of the heads / FFN / vocabulary, the encode still equals the
    reference; a width tp does not divide stays replicated."""
    import jax

    from vidax.core import mesh as vmesh

    model = _ref_model("umt5")
    model.save_pretrained(tmp_path)
    ids, mask = _inputs(CASES["umt5"][3])
    enc = t5.load_t5(tmp_path, mesh=f"tp={tp}")
    cfg = enc.cfg
    assert t5.tp_rules(cfg, tp) == {k: "tp" for k, n in (("heads", cfg.num_heads), ("ffn", cfg.d_ff),
                                                          ("vocab", cfg.vocab_size)) if n % tp == 0}
    leaves = jax.tree.leaves(enc.state)
    assert all(len(x.sharding.device_set) == tp for x in leaves)
    assert any(x.sharding.shard_shape(x.shape) != x.shape for x in leaves)  # split, not replicated
    assert vmesh.axis_sizes(leaves[0].sharding.mesh)["tp"] == tp
    assert_parity(np.asarray(enc(ids, mask)), _ref_out(model, ids, mask), what=f"umt5 tp={tp}")
