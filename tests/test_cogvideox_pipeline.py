"""CogVideoX end to end against diffusers' CogVideoXPipeline / CogVideoXImageToVideoPipeline given the
same prompt embeddings and initial noise: final latents after a few steps (DDIM and the stochastic
DPM with the same noise, dynamic CFG, 1.5's padded frames, I2V's image latents and ofs), decoded
frames; the T5 prompt encode (no mask, float32); decode plans of whole VAE batches."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb

VAE = dict(block_out_channels=(8, 16, 16, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4,
           sample_height=32, sample_width=48)
BASE = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=24,
            text_embed_dim=20, num_layers=2, sample_width=6, sample_height=4, sample_frames=9, max_text_seq_length=7)
SCHED = dict(beta_end=0.012, beta_schedule="scaled_linear", beta_start=0.00085, clip_sample=False,
             num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
             set_alpha_to_one=True, snr_shift_scale=1.0, timestep_spacing="trailing")
CASES = {
    # name: (transformer config, image-to-video, scheduler, dynamic cfg, frames, guidance)
    "2b-ddim": (dict(), False, "ddim", False, 9, 6.0),
    "1.5-dpm-dynamic": (dict(use_rotary_positional_embeddings=True, patch_size_t=2, patch_bias=False,
                             sample_height=8, sample_width=8), False, "dpm", True, 9, 6.0),
    "5b-i2v-ddim": (dict(in_channels=8, use_rotary_positional_embeddings=True,
                         use_learned_positional_embeddings=True), True, "ddim", False, 9, 5.0),
    "1.5-i2v-dpm": (dict(in_channels=8, use_rotary_positional_embeddings=True, patch_size_t=2, patch_bias=False,
                         ofs_embed_dim=24, sample_height=8, sample_width=8), True, "dpm", True, 5, 6.0),
}


def _ref_pipeline(name, folder):
    from diffusers import (AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXDPMScheduler,
                           CogVideoXImageToVideoPipeline, CogVideoXPipeline, CogVideoXTransformer3DModel)

    tcfg, i2v, sched, *_ = CASES[name]
    torch.manual_seed(0)
    transformer = perturb(CogVideoXTransformer3DModel(**{**BASE, **tcfg}), seed=1)
    vae = perturb(AutoencoderKLCogVideoX(**VAE, scaling_factor=0.7, invert_scale_latents=tcfg.get("ofs_embed_dim") is not None),
                  seed=2)
    s = (CogVideoXDPMScheduler if sched == "dpm" else CogVideoXDDIMScheduler)(**SCHED)
    cls = CogVideoXImageToVideoPipeline if i2v else CogVideoXPipeline
    pipe = cls(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, scheduler=s)
    pipe.save_pretrained(folder)
    return pipe


def _noises(seed, n, shape):
    import jax

    key = jax.random.key(seed)
    return [np.asarray(jax.random.normal(jax.random.fold_in(key, i), shape)) for i in range(n)]


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_diffusers(tmp_path, monkeypatch, name):
    import PIL.Image
    from diffusers.pipelines.cogvideo import pipeline_cogvideox_image2video as i2v_mod
    from diffusers.schedulers import scheduling_dpm_cogvideox as dpm_mod

    from vidax.models.cogvideox import vae as cvae
    from vidax.models.cogvideox.pipeline import CogVideoX
    from vidax.pipeline import to_unit_range

    tcfg, i2v, sched, dynamic, frames, guidance = CASES[name]
    pipe = _ref_pipeline(name, tmp_path)
    vx = CogVideoX(tmp_path)
    assert vx.image_to_video == i2v
    h, w, steps, seed, b = 32, 48, 3, 5, 2 if not i2v else 1
    rng = np.random.default_rng(0)
    cond = rng.standard_normal((b, 7, 20)).astype(np.float32)
    uncond = rng.standard_normal((b, 7, 20)).astype(np.float32)
    shape = vx.latent_shape(b, h, w, frames)  # channels-last, 1.5's extra frames included
    lat = rng.standard_normal(shape).astype(np.float32).transpose(0, 1, 4, 2, 3)  # the DiT layout [B, F, C, h, w]
    kw = dict(prompt_embeds=torch.from_numpy(cond), negative_prompt_embeds=torch.from_numpy(uncond),
              latents=torch.from_numpy(lat), num_inference_steps=steps, guidance_scale=guidance, height=h, width=w,
              num_frames=frames, use_dynamic_cfg=dynamic)
    image = None
    if i2v:  # the posterior mean on both sides (vidax samples it from the seed by default)
        image = PIL.Image.fromarray((rng.random((40, 70, 3)) * 255).astype(np.uint8))
        monkeypatch.setattr(i2v_mod, "retrieve_latents", lambda out, generator=None: out.latent_dist.mode())
        kw["image"] = image
    if sched == "dpm":  # the reference's noise draws replaced by vidax's fold_in(key, step) noise
        noise = [torch.from_numpy(a.transpose(0, 1, 4, 2, 3).copy()) for a in _noises(seed, steps, shape)]
        draws = []
        for i in range(steps):
            draws += [torch.zeros_like(noise[i])] * (0 < i < steps - 1) + [noise[i]]
        monkeypatch.setattr(dpm_mod, "randn_tensor", lambda *a, **k: draws.pop(0))
    lf, extra = vx.latent_frames(frames)
    with torch.no_grad():
        ref_lat = pipe(**kw, output_type="latent", return_dict=False)[0]
        # the rest of the reference's __call__ for output_type="np": drop the padding frames, decode
        ref_video = pipe.video_processor.postprocess_video(pipe.decode_latents(ref_lat[:, extra:]), output_type="np")
    ref_lat = ref_lat.numpy()
    img = None if image is None else vx.encode_image(image, h, w, sample=False)
    z = vx.sample_latents(cond, uncond, latents=lat, seed=seed, height=h, width=w, num_frames=frames, steps=steps,
                          guidance=guidance, dynamic_cfg=dynamic, image_latents=img, return_padded=True)
    assert_parity(z, ref_lat.transpose(0, 2, 1, 3, 4), what=f"{name}: final latents after {steps} steps")
    assert z.shape[2] == lf + extra
    vae = vx.load_vae()
    video = to_unit_range(cvae.decode(vae, cvae.from_latents(vae.cfg, z[:, :, extra:])))
    assert video.shape == ref_video.shape, (video.shape, ref_video.shape)
    inside = float(np.mean((ref_video > 0.01) & (ref_video < 0.99)))
    assert inside > 0.5, f"only {inside:.0%} of reference pixels are unclamped; the comparison would be weak"
    assert_parity(video, ref_video, what=f"{name}: decoded frames")


def test_prompt_encode_matches_the_reference(tmp_path):
    """T5 without an attention mask over the padded 226 (here 7) tokens, in float32: the reference
    pipeline's ``_get_t5_prompt_embeds``; the padding rows are used, not zeroed."""
    import jax
    import transformers
    from diffusers import CogVideoXPipeline

    from tests.test_t5 import _train_tokenizer_json
    from vidax.models.cogvideox.pipeline import CogVideoX

    _train_tokenizer_json(tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    torch.manual_seed(0)
    enc = perturb(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=150, d_model=20, d_kv=8, d_ff=40, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu")), seed=3)
    _ref_pipeline("2b-ddim", tmp_path / "p")
    ref = CogVideoXPipeline.from_pretrained(tmp_path / "p", tokenizer=tok, text_encoder=enc)
    ref.save_pretrained(tmp_path / "p")
    prompts = ["a fox in snow", "dogs and cats and videos of foxes under the moon"]
    with torch.no_grad():
        want = ref._get_t5_prompt_embeds(prompts, max_sequence_length=7, device="cpu").numpy()
    got = CogVideoX(tmp_path / "p").encode_prompts(prompts)
    assert got.dtype == np.float32 and got.shape == want.shape == (2, 7, 20)
    assert_parity(got, want, what="T5 prompt embeddings (no mask)")
    assert np.abs(got[0, -1]).max() > 0  # padding positions carry (unmasked) embeddings
    # a bfloat16 checkpoint stays bfloat16 in memory and still encodes in float32: the reference in
    # float32 from the same (bf16-rounded) weights
    enc.to(torch.bfloat16).save_pretrained(tmp_path / "p" / "text_encoder")
    loaded = CogVideoX(tmp_path / "p").load_text_encoder()
    assert {str(a.dtype) for a in jax.tree.leaves(loaded.state)} == {"bfloat16"}
    with torch.no_grad():
        ref.text_encoder = enc.float()
        want = ref._get_t5_prompt_embeds(prompts, max_sequence_length=7, device="cpu").numpy()
    assert_parity(CogVideoX(tmp_path / "p").encode_prompts(prompts, encoder=loaded), want,
                  what="T5 from a bf16 checkpoint, float32 compute")


def test_decode_plan_is_whole_batches():
    from types import SimpleNamespace

    from vidax.models.cogvideox.pipeline import CogVideoX

    p = CogVideoX("tiny")
    for frames, stages, want in [(49, None, [(0, 5), (5, 7), (7, 9), (9, 13)]), (49, 2, [(0, 7), (7, 13)]),
                                 (5, None, [(0, 2)]), (81, 3, [(0, 7), (7, 15), (15, 21)])]:
        plan = p.decode_plan(SimpleNamespace(num_frames=frames, decode_stages=stages))
        assert [s.frames for s in plan] == want
        assert [s.carry_from for s in plan] == [None] + [s.name for s in plan[:-1]]


def test_dynamic_guidance_formula():
    import math

    from vidax.models.cogvideox.pipeline import dynamic_guidance

    ts = [999, 499, 0]
    got = dynamic_guidance(6.0, ts, 50)
    for g, t in zip(got, ts):
        assert g == 1 + 6.0 * ((1 - math.cos(math.pi * ((50 - t) / 50) ** 5.0)) / 2)


def test_one_compiled_step_for_every_step():
    """jit the unit: one compiled step for all steps of a run, reused by the next run."""
    from vidax.core.jit import CompileCounter
    from vidax.models.cogvideox.pipeline import CogVideoX

    p = CogVideoX("tiny-1.5-i2v")
    rng = np.random.default_rng(0)
    cond = rng.standard_normal((1, p.max_text_len, 32)).astype(np.float32)
    img = rng.standard_normal((1, 4, 1, 8, 8)).astype(np.float32)
    kw = dict(height=64, width=64, num_frames=5, guidance=6.0, image_latents=img, dynamic_cfg=True,
              dit=p.load_dit())
    with CompileCounter() as first:
        p.sample_latents(cond, cond, steps=2, seed=1, **kw)
    with CompileCounter() as again:
        p.sample_latents(cond, cond, steps=2, seed=2, **kw)  # another run, same schedule: nothing new
    with CompileCounter() as longer:
        p.sample_latents(cond, cond, steps=5, seed=2, **kw)  # another schedule: its one step program
    print(f"compiles: first run {first.count}, same schedule again {again.count}, 5 steps {longer.count}")
    assert again.count == 0 and longer.count <= 2  # the step, and placing its [9] timestep table


def _config_folder(path, transformer: dict, vae: dict, i2v=False):
    """A diffusers CogVideoX folder with the release's configs and no weights."""
    import json

    for sub, cfg in (("transformer", {"_class_name": "CogVideoXTransformer3DModel", **transformer}),
                     ("vae", {"_class_name": "AutoencoderKLCogVideoX", **vae}),
                     ("scheduler", {"_class_name": "CogVideoXDDIMScheduler", **SCHED})):
        (path / sub).mkdir(parents=True)
        (path / sub / ("scheduler_config.json" if sub == "scheduler" else "config.json")).write_text(json.dumps(cfg))
    cls = "CogVideoXImageToVideoPipeline" if i2v else "CogVideoXPipeline"
    (path / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    return path


def test_release_geometry(tmp_path):
    """The released configs' sizes: 1.0 at 720x480x49, 1.5 at 1360x768x81 (~45k video tokens,
    --mesh auto = dp=2,sp=4 on 8 chips), the 5B-I2V's fixed size, 1.5's rotary limit."""
    from vidax import registry
    from vidax.models.cogvideox.pipeline import CogVideoX
    from vidax.pipeline import OptionError

    v15 = dict(num_attention_heads=48, num_layers=42, patch_size_t=2, patch_bias=False, sample_height=300,
               sample_width=300, sample_frames=81, use_rotary_positional_embeddings=True)
    p = CogVideoX(_config_folder(tmp_path / "15", v15, {"scaling_factor": 0.7, "invert_scale_latents": True}))
    g = p.geometry()
    g.check(768, 1360, 81)
    assert g.tokens(768, 1360, 81) == 11 * 48 * 85 == 44880
    assert p.latent_frames(81) == (21, 1) and p.latent_shape(1, 768, 1360, 81) == (1, 22, 96, 170, 16)
    with pytest.raises(OptionError, match="width"):
        g.check(768, 2416, 81)  # 151 tokens across: past the 'slice' grid's max_size of 150
    assert registry.get("cogvideox1.5-5b").default_mesh(8, 48, g.tokens(768, 1360, 81), True) == "dp=2,sp=4"
    i2v = dict(num_attention_heads=48, num_layers=42, in_channels=32, use_rotary_positional_embeddings=True,
               use_learned_positional_embeddings=True)
    p = CogVideoX(_config_folder(tmp_path / "i2v", i2v, {"scaling_factor": 0.7}, i2v=True))
    g = p.geometry()
    assert p.image_to_video and g.fit_size(900, 1600, 768 * 1360) == (480, 720)
    g.check(480, 720, 49)
    with pytest.raises(OptionError, match="fix its size to 480x720"):
        g.check(480, 848, 49)
    p = CogVideoX(_config_folder(tmp_path / "2b", {}, {}))
    assert p.geometry().tokens(480, 720, 49) == 13 * 30 * 45 and p.scheduler(50).name == "cogvideox_ddim"
    assert p.scheduler(50, "dpm").config["snr_shift_scale"] == 1.0
