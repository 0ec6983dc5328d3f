"""Decoder-LM prompt encoders (Llama 3, Qwen2.5-VL text, Gemma 3) against transformers: every
layer's hidden states, the last hidden state, left and right padding, through ``load_pretrained``
from ``save_pretrained`` folders (bare text models and the multimodal checkpoints whose text tower
sits under a prefix), the scale of all-layer features, bf16 storage, M-RoPE positions, tensor
parallelism on 8 fake CPU devices, compile counts and checkpoint errors."""
from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.refutil import assert_parity, perturb  # noqa: E402
from vidax.compat import load_pretrained  # noqa: E402
from vidax.core import mesh as vmesh  # noqa: E402
from vidax.core import sharding as vsh  # noqa: E402
from vidax.core.jit import CompileCounter  # noqa: E402
from vidax.text import lm  # noqa: E402
from vidax.weights import CheckpointMismatchError, save_safetensors  # noqa: E402

V, T = 120, 13
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)


def _llama():
    # Llama 3 RoPE scaling with a short original context so all three frequency bands occur
    cfg = transformers.LlamaConfig(**TEXT, attention_bias=True, mlp_bias=True, max_position_embeddings=64,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=16))
    return transformers.LlamaModel(cfg)


def _llama_causal():
    return transformers.LlamaForCausalLM(_llama().config)


def _llava():
    """The original HunyuanVideo 1.0 text encoder is llava-llama-3's language model."""
    cfg = transformers.LlavaConfig(text_config=_llama().config.to_dict(), image_token_index=V - 1, vision_config=dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    return transformers.LlavaForConditionalGeneration(cfg)


def _qwen2_causal():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TEXT))


def _qwen_vl():
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[0]))
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def _qwen_text():
    return transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        **TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}))


GEMMA_TEXT = dict(TEXT, num_hidden_layers=4, head_dim=24, sliding_window=4, query_pre_attn_scalar=20,
                  rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window_pattern=2)


def _gemma_vl():
    cfg = transformers.Gemma3Config(
        text_config=GEMMA_TEXT,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    return transformers.Gemma3ForConditionalGeneration(cfg)


def _gemma_text():
    return transformers.Gemma3TextModel(transformers.Gemma3TextConfig(**GEMMA_TEXT))


def _gemma_causal():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA_TEXT))


# name -> (builder, sharded save)
CASES = {"llama": (_llama, True), "qwen2_5_vl": (_qwen_vl, False), "qwen2_5_vl_text": (_qwen_text, False),
         "gemma3": (_gemma_vl, False), "gemma3_text": (_gemma_text, False)}
# the other classes whose text towers load (same text configs as above: they share its compiles)
MORE = {"llama_causal": (_llama_causal, False), "llava": (_llava, False), "qwen2_causal": (_qwen2_causal, False),
        "qwen2": (lambda: transformers.Qwen2Model(_qwen2_causal().config), False),
        "qwen2_5_vl_model": (lambda: transformers.Qwen2_5_VLModel(_qwen_vl().config), False),
        "gemma3_causal": (_gemma_causal, False), "gemma3_model": (lambda: transformers.Gemma3Model(_gemma_vl().config), False)}


def _inputs(side: str, seed: int = 0):
    """B=2, different padding per row (5 and 2 pad tokens), on the given side."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, V, (2, T)).astype(np.int64)
    mask = np.ones((2, T), np.int64)
    for b, n in enumerate((5, 2)):
        if side == "left":
            mask[b, :n] = 0
        else:
            mask[b, T - n:] = 0
    return ids, mask


def _ref_hidden(model, ids, mask, **kw):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), output_hidden_states=True,
                    use_cache=False, **kw)
    return np.stack([h.numpy() for h in out.hidden_states])


@pytest.fixture(scope="module")
def case_models(tmp_path_factory):
    built = {}
    for name, (make, sharded) in {**CASES, **MORE}.items():
        torch.manual_seed(0)
        model = perturb(make(), seed=1)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, **({"max_shard_size": "30KB"} if sharded else {}))
        if sharded:
            assert len(list(folder.glob("*.safetensors"))) > 1
        built[name] = (model, folder)
    return built


# ------------------------------------------------------------------------------------------ config
def test_config_from_hub_style_dicts():
    # Gemma 3 12B's hub config.json: a partial text_config, old-style rope fields
    g = lm.LMConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                             "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                                             "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                             "sliding_window": 1024}})
    assert (g.hidden_size, g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.vocab_size) == (3840, 48, 16, 8, 256, 262208)
    assert g.layer_types[:6] == ("sliding",) * 5 + ("full",) and g.sliding.sum() == 40 and g.sliding_window == 1024
    assert g.rope == lm.Rope(theta=1e6, kind="linear", factor=8.0) and g.rope_local == lm.Rope(theta=1e4)
    assert g.embed_scale == pytest.approx(3840**0.5) and g.norm_offset == 1.0 and g.query_scale == 256**-0.5
    assert g.hidden_act == "gelu_pytorch_tanh" and g.qk_norm and g.sandwich_norm
    # the same through transformers' own (new-format) config
    g2 = lm.LMConfig.from_hf(transformers.Gemma3Config(text_config=dict(
        hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_hidden_layers=48, num_key_value_heads=8,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)).to_dict())
    assert g2 == g
    # Qwen2.5-VL-7B's hub config.json keeps the text fields at the top level
    q = lm.LMConfig.from_hf({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
                             "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                             "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                             "rope_theta": 1000000.0, "vocab_size": 152064, "use_sliding_window": False,
                             "sliding_window": 32768, "max_window_layers": 28,
                             "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                             "vision_config": {"depth": 32}})
    assert (q.hidden_size, q.num_heads, q.num_kv_heads, q.head_dim, q.qkv_bias, q.o_bias) == (3584, 28, 4, 128, True, False)
    assert q.mrope_section == (16, 24, 24) and q.rope == lm.Rope(theta=1e6) and not q.sliding.any()
    # Llama 3.1 RoPE scaling
    ll = lm.LMConfig.from_hf({"architectures": ["LlamaModel"], "model_type": "llama", "hidden_size": 4096,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}})
    assert ll.rope.kind == "llama3" and ll.rope.theta == 5e5 and ll.head_dim == 128 and ll.num_kv_heads == 8
    with pytest.raises(ValueError, match="RoPE type"):
        lm.LMConfig.from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    hash(g)  # static jit argument


def test_rope_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = transformers.LlamaConfig(**TEXT, head_dim=32, rope_theta=5e5, max_position_embeddings=64,
                                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                   high_freq_factor=4.0, original_max_position_embeddings=16))
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](c)
    # float32 pow may differ by an ulp between numpy and torch
    np.testing.assert_allclose(lm.LMConfig.from_hf(c.to_dict()).rope.inv_freq(32), ref.numpy(), rtol=1e-6)
    c = transformers.LlamaConfig(**TEXT, rope_scaling=dict(rope_type="linear", factor=4.0))
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](c)
    np.testing.assert_allclose(lm.LMConfig.from_hf(c.to_dict()).rope.inv_freq(16), ref.numpy(), rtol=1e-6)


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("name", list(CASES))
def test_parity_all_layers_vs_transformers(name, case_models):
    model, folder = case_models[name]
    cm = load_pretrained(folder)
    assert isinstance(cm.model_config, lm.LMConfig)
    L = cm.model_config.num_layers
    for side in ("right", "left"):
        ids, mask = _inputs(side, seed=1 if side == "left" else 0)
        ref = _ref_hidden(model, ids, mask)
        out = cm(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert isinstance(out.hidden_states, tuple) and len(out.hidden_states) == L + 1 == len(ref)
        for i, (a, b) in enumerate(zip(out.hidden_states, ref)):
            assert a.dtype == np.float32
            assert_parity(a, b, what=f"{name} {side}-padded hidden_states[{i}]")
        last = cm.forward(input_ids=ids, attention_mask=mask)
        assert_parity(last, ref[-1], what=f"{name} {side}-padded last_hidden_state")
        np.testing.assert_array_equal(out.last_hidden_state, out.hidden_states[-1])
    if name != "llama":
        return
    # no mask at all
    ids, _ = _inputs("right")
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), output_hidden_states=True, use_cache=False).hidden_states[-1]
    assert_parity(cm.forward(input_ids=ids), ref.numpy(), what=f"{name} unmasked")


@pytest.mark.parametrize("name", list(MORE))
def test_other_classes_load_their_text_tower(name, case_models):
    """``*ForCausalLM`` (lm_head ignored) and Llava (vision tower + projector ignored): every layer."""
    model, folder = case_models[name]
    cm = load_pretrained(folder)
    ids, mask = _inputs("left" if name.startswith("gemma") else "right")
    ref = _ref_hidden(model, ids, mask)
    out = cm(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref)
    for i, (a, b) in enumerate(zip(out.hidden_states, ref)):
        assert_parity(a, b, what=f"{name} hidden_states[{i}]")


def test_layer_selection_and_feature_scale(case_models):
    """The selections the pipelines use, and the scale of all-layer features: per-layer RMS over
    the real tokens equals the reference's (the LTX-2 bug fed a ~7x weaker signal with every
    shape right), and ``layer(k)`` is exactly ``hidden_states[k]``."""
    model, folder = case_models["gemma3"]
    enc = lm.load_lm(folder)
    ids, mask = _inputs("left")
    ref = _ref_hidden(model, ids, mask)
    hs = np.asarray(enc.hidden_states(ids, mask))
    assert hs.shape == (enc.cfg.num_layers + 1, 2, T, enc.cfg.hidden_size)
    valid = mask.astype(bool)
    rms = lambda a: np.sqrt(np.mean(np.square(a[:, valid]), axis=-1))  # noqa: E731
    ratio = rms(hs) / rms(ref)
    print("per-layer RMS ratio vidax / transformers:", ratio)
    np.testing.assert_allclose(ratio, 1.0, rtol=1e-5)
    # the embeddings really are scaled by sqrt(D) (Gemma), the layers grow the signal as the reference does
    emb = np.asarray(enc.state["embed"]["embedding"])[ids]
    np.testing.assert_allclose(hs[0], emb * np.float32(np.sqrt(enc.cfg.hidden_size)), rtol=1e-6)
    for k in (0, -3, -1):  # -3: HunyuanVideo's 'skip 2 layers'
        np.testing.assert_allclose(np.asarray(enc.layer(ids, mask, index=k)), hs[k], rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError):
        enc.layer(ids, mask, index=enc.cfg.num_layers + 1)
    # a template prefix cropped as the pipelines do
    x, m = lm.crop(hs[-3], mask, 4)
    assert x.shape == (2, T - 4, enc.cfg.hidden_size) and m.shape == (2, T - 4)
    np.testing.assert_array_equal(x, hs[-3][:, 4:])
    xs, _ = lm.crop(hs, mask, 4)
    assert xs.shape == (hs.shape[0], 2, T - 4, hs.shape[-1])


def test_padding_does_not_leak_into_real_tokens(case_models):
    _, folder = case_models["llama"]
    enc = lm.load_lm(folder)
    ids, mask = _inputs("right")
    full = np.asarray(enc(ids, mask))
    ids2 = ids.copy()
    ids2[mask == 0] = 7  # garbage in padded slots
    np.testing.assert_allclose(np.asarray(enc(ids2, mask))[mask == 1], full[mask == 1], rtol=1e-6, atol=1e-6)
    short = np.asarray(enc(ids[:1, :T - 5], mask[:1, :T - 5]))
    np.testing.assert_allclose(full[:1, :T - 5], short, rtol=1e-5, atol=1e-5)


def test_mrope_positions_and_inputs_embeds(case_models):
    """Qwen2.5-VL with explicit 3-row positions (distinct per section) and inputs_embeds."""
    model, folder = case_models["qwen2_5_vl_text"]
    cm = load_pretrained(folder)
    ids, mask = _inputs("right")
    rng = np.random.default_rng(3)
    pos = np.stack([np.arange(T) + rng.integers(0, 5), np.arange(T) * 2, np.arange(T)[::-1]])[:, None].repeat(2, 1)
    ref = _ref_hidden(model, ids, mask, position_ids=torch.from_numpy(pos.astype(np.int64)))
    out = cm(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    assert_parity(out.hidden_states[-2], ref[-2], what="M-RoPE positions")
    # positions [B, T] (e.g. shifted for left padding)
    pos2 = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = _ref_hidden(model, ids, mask, position_ids=torch.from_numpy(pos2))
    assert_parity(cm.forward(input_ids=ids, attention_mask=mask, position_ids=pos2), ref[-1], what="2-D positions")
    emb = np.random.default_rng(4).standard_normal((2, 7, 64)).astype(np.float32)
    with torch.no_grad():
        ref = model(inputs_embeds=torch.from_numpy(emb), attention_mask=torch.from_numpy(mask[:, :7]),
                    output_hidden_states=True)
    out = cm(inputs_embeds=emb, attention_mask=mask[:, :7], output_hidden_states=True)
    for i in range(len(ref.hidden_states)):
        assert_parity(out.hidden_states[i], ref.hidden_states[i].numpy(), what=f"inputs_embeds hs[{i}]")


def test_bf16_storage_computes_in_fp32(case_models):
    model, folder = case_models["gemma3_text"]
    enc = lm.load_lm(folder, dtype=ml_dtypes.bfloat16)
    assert enc.state["blocks"]["q"]["kernel"].dtype == ml_dtypes.bfloat16
    ids, mask = _inputs("left")
    out = np.asarray(enc.hidden_states(ids, mask))
    assert out.dtype == np.float32
    ref_model = _gemma_text()
    ref_model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    ref = _ref_hidden(ref_model.eval(), ids, mask)
    for i in range(len(ref)):
        assert_parity(out[i], ref[i], what=f"bf16 storage hs[{i}]")


# ------------------------------------------------------------------------------------------ jit, axes, errors
def test_compile_once_per_shape():
    cfg = lm.LMConfig.from_hf(_gemma_text().config.to_dict())
    enc = lm.init(cfg, seed=0)
    ids, mask = _inputs("left")
    enc.hidden_states(ids, mask)
    enc(ids, mask)
    with CompileCounter() as cc:
        enc.hidden_states((ids + 1) % V, mask[::-1].copy())
        lm.init(cfg, seed=1).hidden_states(ids, mask)  # other weights, same graph
        enc(ids, 1 - mask)
    assert cc.count == 0, f"{cc.count} recompiles for same-shape calls"
    params = nnx.to_pure_dict(enc.state)
    for a in jax.tree.leaves(params):
        assert np.all(np.asarray(a) != 0) and not np.all(np.asarray(a) == 1)


def test_parameters_carry_logical_axes():
    cfg = lm.LMConfig.from_hf(_gemma_text().config.to_dict())
    enc = lm.abstract(cfg)
    params = {jax.tree_util.keystr(p): v for p, v in
              jax.tree_util.tree_leaves_with_path(enc.state, is_leaf=lambda x: isinstance(x, nnx.Variable))}
    axes = {k: v.get_metadata()["out_sharding"] for k, v in params.items()}
    for k, v in params.items():
        assert len(axes[k]) == len(v.shape), k
    assert axes["['embed']['embedding']"] == ("vocab", "embed")
    assert axes["['blocks']['q']['kernel']"] == ("layers", "embed", "heads")
    assert axes["['blocks']['k']['kernel']"] == ("layers", "embed", "kv_heads")
    assert axes["['blocks']['o']['kernel']"] == ("layers", "heads", "embed")
    assert axes["['blocks']['gate']['kernel']"] == ("layers", "embed", "ffn")
    assert axes["['blocks']['down']['kernel']"] == ("layers", "ffn", "embed")


def test_mismatched_checkpoints_raise(tmp_path, case_models):
    model, _ = case_models["llama"]
    cfg = lm.LMConfig.from_hf(model.config.to_dict())
    good = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    lm.load_params_from(good, cfg)
    key = "layers.1.self_attn.k_proj.bias"
    missing = {k: v for k, v in good.items() if k != key}
    with pytest.raises(CheckpointMismatchError, match=r"missing.*layers\.1\.self_attn\.k_proj\.bias"):
        lm.load_params_from(missing, cfg)
    bad = dict(good, **{"layers.0.mlp.up_proj.weight": np.zeros((95, 64), np.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"mis-shaped.*up_proj"):
        lm.load_params_from(bad, cfg)
    extra = dict(good, **{"layers.3.input_layernorm.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointMismatchError, match=r"unexpected.*layers\.3\.input_layernorm"):
        lm.load_params_from(extra, cfg)
    save_safetensors(missing, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(model.config.to_dict(), architectures=["LlamaModel"])))
    with pytest.raises(CheckpointMismatchError, match=r"k_proj\.bias"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="only the text tower"):
        load_pretrained(_folder_of(case_models, "qwen2_5_vl")).forward(input_ids=np.ones((1, 3), np.int64),
                                                                       pixel_values=np.zeros((4, 8), np.float32))


def _folder_of(case_models, name):
    return case_models[name][1]


# ------------------------------------------------------------------------------------------ tensor parallelism
@pytest.mark.parametrize("tp,kv", [(8, 2), (2, 2)])
def test_tensor_parallel_matches_one_device(tp, kv):
    """tp=8 with 2 kv heads (k/v replicated, query heads / FFN / vocabulary sharded) and tp=2 with
    kv heads sharded too; sliding + global Gemma layers, biased Llama-style projections."""
    cfg = lm.LMConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=8, num_kv_heads=kv,
                      head_dim=16, qkv_bias=True, o_bias=True, mlp_bias=True, norm_offset=1.0, embed_scale=8.0,
                      qk_norm=True, sandwich_norm=True, layer_types=("sliding", "full", "sliding"), sliding_window=5,
                      rope=lm.Rope(theta=1e4), rope_local=lm.Rope(theta=100.0), hidden_act="gelu_pytorch_tanh")
    enc = lm.init(cfg, seed=3)
    ids, mask = _inputs("left")
    ids = ids % 128
    ref = np.asarray(enc.hidden_states(ids, mask))
    rules = lm.tp_rules(cfg, tp)
    assert rules.get("heads") == "tp" and rules.get("ffn") == "tp" and rules.get("vocab") == "tp"
    assert ("kv_heads" in rules) == (kv % tp == 0)
    sharded = lm.shard(enc, vmesh.make_mesh(f"tp={tp}"))
    q = sharded.state["blocks"]["q"]["kernel"]
    assert len(q.sharding.device_set) == tp and q.addressable_shards[0].data.shape == (3, 64, 128 // tp)
    out = np.asarray(sharded.hidden_states(ids, mask))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    print(f"tp={tp} kv={kv}: max err / max|ref| = {err:.2e}")
    assert err <= 1e-5
    mesh, specs, _ = lm.shardings(enc, cfg, f"tp={tp}")
    per_dev, total = vsh.per_device_bytes(enc.state, specs, mesh), vsh.tree_bytes(enc.state)
    print(f"per-device bytes {per_dev} of {total} ({per_dev / total:.3f})")
    assert per_dev <= total * (1 / tp + 0.12), (per_dev, total)


def test_load_pretrained_on_a_tp_mesh(case_models):
    """``load_pretrained(folder, mesh="tp=2")`` and ``load_lm(..., mesh=)``: each device gets its
    slices, the encode equals the reference."""
    model, folder = case_models["gemma3"]
    cm = load_pretrained(folder, mesh="tp=2")
    k = cm.encoder.state["blocks"]["k"]["kernel"]
    assert len(k.sharding.device_set) == 2 and k.addressable_shards[0].data.shape[-1] == k.shape[-1] // 2
    ids, mask = _inputs("left")
    ref = _ref_hidden(model, ids, mask)
    assert_parity(cm(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2], ref[-2],
                  what="tp=2 load_pretrained")
    assert_parity(np.asarray(lm.load_lm(folder, mesh="tp=2").layer(ids, mask, index=-1)), ref[-1], what="tp=2 load_lm")
    with pytest.raises(ValueError, match="offload"):
        load_pretrained(folder, offload_chunk_size=1)


def test_tp_rules_for_the_real_models():
    g12 = lm.LMConfig(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48, num_heads=16,
                      num_kv_heads=8, head_dim=256)
    assert lm.tp_rules(g12, 8) == {"heads": "tp", "kv_heads": "tp", "ffn": "tp", "vocab": "tp"}
    q7 = lm.LMConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                     num_kv_heads=4, head_dim=128)
    assert lm.tp_rules(q7, 4) == {"heads": "tp", "kv_heads": "tp", "ffn": "tp", "vocab": "tp"}
    assert lm.tp_rules(q7, 8) == {"ffn": "tp", "vocab": "tp"}  # 28 heads: attention replicated on 8
    l8 = lm.LMConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128)
    assert lm.tp_rules(l8, 16) == {"heads": "tp", "ffn": "tp", "vocab": "tp"}  # kv replicated
    assert lm.tp_rules(l8, 1) == {}
