"""Benchmark rows for the shared conditioning encoders (``vidax.text``) vs transformers, same
machine, same run: one forward each at a small but realistic width. Every case returns
``dict(component, config, vidax, reference, flops=None)``; both callables block until done (the vidax one
through ``jax.block_until_ready``, the reference under ``torch.no_grad``).

The vidax side is what the pipelines call: the decoder LMs' ``hidden_states`` (all layers, what
LTX-2 / Cosmos use), CLIP text's pooled output, SigLIP's last hidden state, ByT5's last hidden
state; the reference side the transformers call that produces the same tensors."""
from __future__ import annotations

import numpy as np


def _torch():
    import torch

    from tests.refutil import perturb

    return torch, perturb


def _sd(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _lm_case(name: str, make_ref, T: int = 256, left: bool = False):
    def case():
        import jax

        from vidax.text import lm

        torch, perturb = _torch()
        torch.manual_seed(0)
        ref = perturb(make_ref())
        cfg = lm.LMConfig.from_hf(ref.config.to_dict())
        enc = lm.from_params(cfg, lm.load_params_from(_sd(ref), cfg))
        rng = np.random.default_rng(0)
        ids = rng.integers(1, cfg.vocab_size, (1, T)).astype(np.int64)
        mask = np.ones((1, T), np.int64)
        if left:
            mask[:, : T // 4] = 0
        else:
            mask[:, 3 * T // 4:] = 0
        ij, mj = jax.numpy.asarray(ids, jax.numpy.int32), jax.numpy.asarray(mask, jax.numpy.int32)
        it, mt = torch.from_numpy(ids), torch.from_numpy(mask)

        def run_vidax():
            jax.block_until_ready(enc.hidden_states(ij, mj))

        def run_ref():
            with torch.no_grad():
                ref(input_ids=it, attention_mask=mt, output_hidden_states=True, use_cache=False)

        D, H, KV, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        per_layer = 2 * T * (D * (H + 2 * KV) * hd + H * hd * D + 3 * D * F) + 4 * T * T * H * hd
        return dict(component=f"{name} (all hidden states, vs transformers)",
                    config=f"{cfg.num_layers} layers, D {D}, {H}/{KV} heads, FFN {F}, {T} tokens",
                    vidax=run_vidax, reference=run_ref, flops=cfg.num_layers * per_layer)

    case.__name__ = f"bench_{name.lower().replace(' ', '_').replace('.', '')}"
    return case


def _llama():
    import transformers

    return transformers.LlamaModel(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, rope_theta=500000.0, max_position_embeddings=8192,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)))


def _qwen():
    import transformers

    return transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}))


def _gemma():
    import transformers

    return transformers.Gemma3TextModel(transformers.Gemma3TextConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=128, sliding_window=128, sliding_window_pattern=2,
        rope_scaling=dict(rope_type="linear", factor=8.0)))


bench_llama3 = _lm_case("Llama 3 text", _llama)
bench_qwen25vl = _lm_case("Qwen2.5-VL text", _qwen)
bench_gemma3 = _lm_case("Gemma 3 text", _gemma, left=True)


def bench_clip_text():
    import jax
    import transformers

    from vidax.text import clip_text

    torch, perturb = _torch()
    torch.manual_seed(0)
    ref = perturb(transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=12,
        max_position_embeddings=77)))
    cfg = clip_text.CLIPTextConfig.from_hf(ref.config.to_dict())
    enc = clip_text.from_params(cfg, clip_text.load_params_from(_sd(ref), cfg))
    ids = np.random.default_rng(0).integers(1, 49406, (2, 77)).astype(np.int64)
    ids[:, 20] = 49407
    ij, it = jax.numpy.asarray(ids, jax.numpy.int32), torch.from_numpy(ids)

    def run_vidax():
        jax.block_until_ready(enc(ij)["pooler_output"])

    def run_ref():
        with torch.no_grad():
            ref(input_ids=it)

    return dict(component="CLIP text pooled (vs transformers CLIPTextModel)", config="4 layers, D 768, 12 heads, 2 x 77 tokens",
                vidax=run_vidax, reference=run_ref)


def bench_siglip_vision():
    import jax
    import transformers

    from vidax.text import siglip

    torch, perturb = _torch()
    torch.manual_seed(0)
    ref = perturb(transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=12, image_size=224,
        patch_size=16)))
    cfg = siglip.SiglipVisionConfig.from_hf(ref.config.to_dict())
    enc = siglip.from_params(cfg, siglip.load_params_from(_sd(ref), cfg))
    px = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    pj, pt = jax.numpy.asarray(px), torch.from_numpy(px)

    def run_vidax():
        jax.block_until_ready(enc(pj)["last_hidden_state"])

    def run_ref():
        with torch.no_grad():
            ref(pixel_values=pt)

    return dict(component="SigLIP vision (vs transformers SiglipVisionModel)",
                config="4 layers, D 768, 12 heads, 224 px / 16 (196 tokens), head",
                vidax=run_vidax, reference=run_ref)


def bench_byt5():
    import jax
    import transformers

    from vidax.text import t5

    torch, perturb = _torch()
    torch.manual_seed(0)
    ref = perturb(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=4, num_heads=6, feed_forward_proj="gated-gelu")))
    cfg = t5.T5Config.from_hf(ref.config.to_dict())
    enc = t5.from_params(cfg, t5.load_params_from(_sd(ref), cfg))
    ids = np.random.default_rng(0).integers(3, 259, (1, 256)).astype(np.int64)
    mask = np.zeros((1, 256), np.int64)
    mask[:, :100] = 1
    ij, mj = jax.numpy.asarray(ids, jax.numpy.int32), jax.numpy.asarray(mask, jax.numpy.int32)
    it, mt = torch.from_numpy(ids), torch.from_numpy(mask)

    def run_vidax():
        jax.block_until_ready(enc(ij, mj))

    def run_ref():
        with torch.no_grad():
            ref(input_ids=it, attention_mask=mt)

    return dict(component="ByT5 encoder (vs transformers T5EncoderModel)", config="4 layers, d_model 1472, 6 heads, 256 bytes",
                vidax=run_vidax, reference=run_ref)


CASES = [bench_llama3, bench_qwen25vl, bench_gemma3, bench_clip_text, bench_siglip_vision, bench_byt5]
