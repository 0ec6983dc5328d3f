"""HunyuanVideo 1.5 pipelines: a few sampling steps of diffusers' HunyuanVideo15Pipeline (CFG,
B=2 with different padding, decode included) and HunyuanVideo15ImageToVideoPipeline (SigLIP,
image latent, bucketed size) match vidax's from the same embeddings and noise; the scheduler over
a whole schedule; the glyph extraction and the prompt template's system message; the sizes."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax.models.hunyuanvideo15 import dit as hdit
from vidax.models.hunyuanvideo15 import pipeline as hpipe
from vidax.models.hunyuanvideo15 import text as htext
from vidax.models.hunyuanvideo15 import vae as hvae

DIT = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
           num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=24, text_embed_2_dim=20, image_embed_dim=12,
           rope_axes_dim=(2, 2, 4), target_size=32)
VAE = dict(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1, spatial_compression_ratio=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    out = {}
    for task in ("t2v", "i2v"):
        m = perturb(HunyuanVideo15Transformer3DModel(**DIT, task_type=task), seed=1)
        f = tmp_path_factory.mktemp(f"hv15p_{task}")
        m.save_pretrained(f)
        out[task] = (m, hdit.load_dit(f))
    v = perturb(AutoencoderKLHunyuanVideo15(**VAE), seed=2)
    f = tmp_path_factory.mktemp("hv15p_vae")
    v.save_pretrained(f)
    out["vae"] = (v, hvae.load_vae(f))
    return out


def _cond(rng, b, lens, glyph_lens):
    emb = rng.standard_normal((b, 10, 24)).astype(np.float32)
    mask = np.array([[1] * n + [0] * (10 - n) for n in lens], np.int64)
    emb2 = rng.standard_normal((b, 6, 20)).astype(np.float32)
    mask2 = np.array([[1] * n + [0] * (6 - n) for n in glyph_lens], np.int64)
    return {"embeds": emb, "mask": mask, "embeds_2": emb2, "mask_2": mask2}


def _sched(shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=shift)


def test_t2v_pipeline_parity(models):
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    ref_dit, (state, cfg) = models["t2v"]
    ref_vae, vae = models["vae"]
    rng = np.random.default_rng(0)
    b, steps, shift, g = 2, 3, 5.0, 6.0
    cond, uncond = _cond(rng, b, (7, 4), (3, 0)), _cond(rng, b, (2, 2), (0, 0))
    noise = rng.standard_normal((b, 4, 3, 4, 4)).astype(np.float32)  # 9 frames, 16 x 16
    pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=ref_dit, vae=ref_vae,
                                  scheduler=_sched(shift), text_encoder_2=None, tokenizer_2=None,
                                  guider=ClassifierFreeGuidance(guidance_scale=g))
    pipe.vision_num_semantic_tokens = 5
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    with torch.no_grad():
        ref = pipe(prompt_embeds=t(cond["embeds"]), prompt_embeds_mask=t(cond["mask"]),
                   prompt_embeds_2=t(cond["embeds_2"]), prompt_embeds_mask_2=t(cond["mask_2"]),
                   negative_prompt_embeds=t(uncond["embeds"]), negative_prompt_embeds_mask=t(uncond["mask"]),
                   negative_prompt_embeds_2=t(uncond["embeds_2"]), negative_prompt_embeds_mask_2=t(uncond["mask_2"]),
                   height=16, width=16, num_frames=9, num_inference_steps=steps, latents=t(noise),
                   output_type="latent").frames
        # the pipeline's decode (its VAE's mid attention only runs batch 1: one row at a time)
        ref_video = np.concatenate([to_numpy((ref_vae.decode(r[None] / ref_vae.config.scaling_factor).sample * 0.5
                                              + 0.5).clamp(0, 1)) for r in ref])
    p = hpipe.HunyuanVideo15T2V("tiny")
    lat = p.sample_latents(cond, uncond, latents=noise, steps=steps, guidance=g, shift=shift, dit=(state, cfg))
    assert_parity(lat, to_numpy(ref), what="HunyuanVideo15Pipeline latents")
    from vidax.core.jit import CompileCounter

    with CompileCounter() as cc:  # other prompts, other noise, another guidance: the same step program
        p.sample_latents(_cond(rng, b, (2, 9), (6, 1)), uncond, latents=noise + 1, steps=steps, guidance=3.0,
                         shift=shift, dit=(state, cfg))
    assert cc.count == 0
    video = p.decode_video(lat, vae, tiling=False)  # [B, F, H, W, 3] in [0, 1]
    assert_parity(video, ref_video.transpose(0, 2, 3, 4, 1), what="HunyuanVideo15Pipeline decoded video")


def test_i2v_pipeline_parity(models):
    import PIL.Image
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    from vidax.text import siglip

    ref_dit, (state, cfg) = models["i2v"]
    ref_vae, vae = models["vae"]
    torch.manual_seed(0)
    enc = perturb(SiglipVisionModel(SiglipVisionConfig(hidden_size=12, intermediate_size=24, num_hidden_layers=2,
                                                       num_attention_heads=2, image_size=32, patch_size=8,
                                                       vision_use_head=False)), seed=4)
    fx = SiglipImageProcessor(size={"height": 32, "width": 32})
    rng = np.random.default_rng(1)
    img = rng.uniform(0, 255, (45, 70, 3)).astype(np.uint8)
    b, steps, shift, g = 1, 2, 7.0, 6.0
    cond, uncond = _cond(rng, b, (6,), (2,)), _cond(rng, b, (3,), (0,))
    height, width = hpipe.bucket_size(45, 70, DIT["target_size"], 4)
    noise = rng.standard_normal((b, 4, 2, height // 4, width // 4)).astype(np.float32)
    pipe = HunyuanVideo15ImageToVideoPipeline(text_encoder=None, tokenizer=None, transformer=ref_dit, vae=ref_vae,
                                              scheduler=_sched(shift), text_encoder_2=None, tokenizer_2=None,
                                              guider=ClassifierFreeGuidance(guidance_scale=g), image_encoder=enc,
                                              feature_extractor=fx)
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    with torch.no_grad():
        ref = pipe(image=PIL.Image.fromarray(img), prompt_embeds=t(cond["embeds"]), prompt_embeds_mask=t(cond["mask"]),
                   prompt_embeds_2=t(cond["embeds_2"]), prompt_embeds_mask_2=t(cond["mask_2"]),
                   negative_prompt_embeds=t(uncond["embeds"]), negative_prompt_embeds_mask=t(uncond["mask"]),
                   negative_prompt_embeds_2=t(uncond["embeds_2"]), negative_prompt_embeds_mask_2=t(uncond["mask_2"]),
                   num_frames=5, num_inference_steps=steps, latents=t(noise), output_type="latent").frames
    import tempfile

    p = hpipe.HunyuanVideo15I2V("tiny-i2v")
    with tempfile.TemporaryDirectory() as d:
        enc.save_pretrained(d)
        sig = siglip.load_siglip(d)
    p.load_image_encoder = lambda: sig
    emb, img_lat = p.encode_image(img, height, width, vae, tiling=False)
    lat = p.sample_latents(cond, uncond, latents=noise, steps=steps, guidance=g, shift=shift, dit=(state, cfg),
                           image_embeds=emb, image_latents=img_lat)
    assert_parity(lat, to_numpy(ref), what="HunyuanVideo15ImageToVideoPipeline latents")


def test_scheduler_whole_schedule():
    """The releases' schedules (shift 5 / 7 / 9 on linspace(1, 0, N + 1)[:-1]) step for step."""
    rng = np.random.default_rng(0)
    p = hpipe.HunyuanVideo15T2V("tiny")
    for shift in (5.0, 7.0, 9.0):
        ref = _sched(shift)
        ref.set_timesteps(sigmas=np.linspace(1.0, 0.0, 8 + 1)[:-1])
        s = p.scheduler(8, shift)
        np.testing.assert_allclose(np.asarray(s.timesteps, np.float64), ref.timesteps.numpy(), rtol=1e-6)
        x = rng.standard_normal((1, 4, 3)).astype(np.float32)
        xr, st = torch.from_numpy(x), s.init_state(x)
        import jax.numpy as jnp

        xj = jnp.asarray(x)
        for i, t in enumerate(ref.timesteps):
            v = rng.standard_normal(x.shape).astype(np.float32)
            xr = ref.step(torch.from_numpy(v), t, xr).prev_sample
            xj, st = s.step(st, jnp.asarray(v), jnp.int32(i), xj)
        assert_parity(np.asarray(xj), xr.numpy(), what=f"flow-match Euler shift {shift}")


def test_glyph_text_and_system_message():
    from diffusers.pipelines.hunyuan_video1_5 import pipeline_hunyuan_video1_5 as ref

    for prompt in ('a sign "OPEN" and “café” and "OPEN"', 'one "x"', "no quotes", '"" empty', '"a" "b" "a"'):
        assert htext.extract_glyph_text(prompt) == ref.extract_glyph_texts(prompt), prompt
    import inspect

    assert htext.SYSTEM_MESSAGE == inspect.signature(
        ref.HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    assert htext.chat_text("") .count("user\n \n") == 0 and "user\n <|im_end|>" in htext.chat_text("")


def test_sizes():
    """The I2V size rule (the pipelines' aspect buckets at target_size) is what the stages use."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    proc = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    for ih, iw, target in ((720, 1280, 640), (1080, 1920, 960), (1000, 700, 640), (512, 512, 960), (300, 1500, 640)):
        assert hpipe.bucket_size(ih, iw, target) == tuple(proc.calculate_default_height_width(ih, iw, target))
    g = hpipe.HunyuanVideo15I2V("tiny-i2v").geometry()
    assert g.latent_channels == 4 and g.size_multiple == 4
    assert g.fit_size(90, 160, area=1) == hpipe.bucket_size(90, 160, 64, 4)
    h, w = g.fit_size(90, 160, area=1, sp=7)
    assert ((h // 4) * (w // 4)) % 7 == 0
    assert hpipe.HunyuanVideo15T2V("tiny").geometry().target_size is None


PROMPTS = ['A red panda paddles a canoe "HELLO" at dawn', "", 'a robot arm welding “café” and "OK" and "OK"']


def test_prompt_conditioning_matches_the_pipelines(tmp_path):
    """_get_mllm_prompt_embeds (Qwen chat template with the system message, max_length + crop,
    hidden_states[-3], crop of embeddings and mask; "" -> " ") and _get_byt5_prompt_embeds (glyph
    extraction, ByT5 to 256... here 24 tokens, zeros without quotes) vs vidax from saved folders."""
    import transformers
    from diffusers import HunyuanVideo15Pipeline as Ref

    from tests.cosmos_fixtures import make_tokenizer
    from vidax.text import lm, t5
    from vidax.text.byt5 import ByT5Tokenizer
    from vidax.text.tokenizer import load_tokenizer

    make_tokenizer(tmp_path / "tok")
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    torch.manual_seed(0)
    qwen = perturb(transformers.Qwen2_5_VLTextModel(transformers.Qwen2_5_VLTextConfig(
        vocab_size=400, hidden_size=24, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 1]})), seed=4)
    qwen.save_pretrained(tmp_path / "qwen")
    tok = load_tokenizer(tmp_path / "tok")
    crop = htext.template_prefix_tokens(tok)
    with torch.no_grad():
        emb, mask = Ref._get_mllm_prompt_embeds(qwen, ref_tok, PROMPTS, "cpu", tokenizer_max_length=12, crop_start=crop)
    out, out_mask = htext.qwen_embeds(tok, lm.load_lm(tmp_path / "qwen"), PROMPTS, crop, 12)
    assert_parity(out, to_numpy(emb), what="Qwen2.5-VL prompt embeds (hidden_states[-3], cropped)")
    np.testing.assert_array_equal(out_mask, mask.numpy())

    byt5 = perturb(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=384, d_model=20, d_kv=8, d_ff=32, num_layers=2, num_heads=2, feed_forward_proj="gated-gelu")), seed=5)
    byt5.save_pretrained(tmp_path / "byt5")
    with torch.no_grad():
        emb2, mask2 = Ref._get_byt5_prompt_embeds(transformers.ByT5Tokenizer(), byt5, PROMPTS, "cpu", tokenizer_max_length=24)
    out2, out_mask2 = htext.glyph_embeds(ByT5Tokenizer(), t5.load_t5(tmp_path / "byt5"), PROMPTS, 20, 24)
    assert_parity(out2, to_numpy(emb2), what="ByT5 glyph embeds")
    np.testing.assert_array_equal(out_mask2, mask2.numpy())
    assert out_mask2[1].sum() == 0 and out_mask2[0].sum() > 0


def test_sampling_on_a_mesh_offloaded():
    """tp=2 x sp=2 with the block stack streamed (chunk 1) and CFG equals one device."""
    rng = np.random.default_rng(3)
    cond = {"embeds": rng.standard_normal((1, 8, 24)).astype(np.float32), "mask": np.array([[1] * 5 + [0] * 3]),
            "embeds_2": rng.standard_normal((1, 4, 20)).astype(np.float32), "mask_2": np.array([[1, 1, 0, 0]])}
    uncond = {**cond, "mask": np.array([[1] * 2 + [0] * 6]), "mask_2": np.zeros((1, 4), np.int64)}
    noise = rng.standard_normal((1, 4, 2, 4, 4)).astype(np.float32)
    kw = dict(latents=noise, steps=2, guidance=4.0)
    one = hpipe.HunyuanVideo15T2V("tiny").sample_latents(cond, uncond, **kw)
    many = hpipe.HunyuanVideo15T2V("tiny", mesh="tp=2,sp=2", offload_chunk_size=1).sample_latents(cond, uncond, **kw)
    assert_parity(many, one, tol=1e-5, what="sampling on tp=2 x sp=2, offloaded")


def test_denoise_once_is_one_euler_step():
    """The probe's clean estimate at sigma 1 is where a 1-step run (no guidance) lands (I2V: the
    image tokens and latent channels enter both alike; T2V is the same call without them)."""
    for cls, src in ((hpipe.HunyuanVideo15I2V, "tiny-i2v"),):
        pipe = cls(src)
        rng = np.random.default_rng(0)
        cond = _cond(rng, 1, (6,), (2,))  # the tiny presets' widths: Qwen 24, ByT5 20, SigLIP 12
        x = rng.standard_normal((1, 4, 2, 4, 4)).astype(np.float32)
        kw, conditioning = {}, {f"prompt_{k}": v for k, v in cond.items()}
        if pipe.image_to_video:
            kw = dict(image_embeds=rng.standard_normal((1, 16, 12)).astype(np.float32),
                      image_latents=rng.standard_normal((1, 4, 1, 4, 4)).astype(np.float32))
            conditioning.update(kw)
        ref = pipe.sample_latents(cond, latents=x, steps=1, guidance=1.0, **kw)
        got = pipe.denoise_once(x, np.array([1.0]), conditioning)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

