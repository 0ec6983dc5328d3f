"""LTX-Video 0.9 pipelines against diffusers' ``LTXPipeline`` / ``LTXImageToVideoPipeline``: a few
sampling steps from the same embeddings (masked) and initial noise give the same latents (CFG,
guidance rescale, per-token image-to-video timesteps); the decode phase equals the reference's
(denormalise, timestep-conditioned VAE decode)."""
import json

import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy

DIT = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12, cross_attention_dim=24,
           num_layers=2, caption_channels=16)
VAE = dict(latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 32),
           layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
           decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
           upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4)
SCHED = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
             base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    root = tmp_path_factory.mktemp("ltx_pipe")
    torch.manual_seed(0)
    dit = perturb(LTXVideoTransformer3DModel(**DIT), seed=1)
    vae = perturb(AutoencoderKLLTXVideo(**VAE), seed=2)
    with torch.no_grad():
        vae.latents_mean.add_(0.1 * torch.randn(8))
        vae.latents_std.add_(0.1 * torch.rand(8))
    sched = FlowMatchEulerDiscreteScheduler(**SCHED)
    dit.save_pretrained(root / "transformer")
    vae.save_pretrained(root / "vae")
    sched.save_pretrained(root / "scheduler")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline", "transformer": ["diffusers", "x"]}))
    return root, dit, vae, sched


def _embeds(b=2, seed=0):
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((b, 7, DIT["caption_channels"])).astype(np.float32)
    m = np.ones((b, 7), np.float32)
    m[-1, 5:] = 0
    return e, m


@pytest.mark.parametrize("i2v", [False, True])
def test_sampling_matches_diffusers(folder, i2v):
    from diffusers import LTXImageToVideoPipeline, LTXPipeline

    from vidax.models.ltx.common import pack
    from vidax.models.ltx.ltxv import LTXVideo

    root, dit, vae, sched = folder
    h, w, frames, steps = 64, 96, 17, 3
    cond, cm = _embeds(2, 0)
    unc, um = _embeds(2, 1)
    pipe = LTXVideo(str(root), image_to_video=i2v)
    grid = pipe.latent_grid(h, w, frames)
    x0 = np.random.default_rng(3).standard_normal((2, *grid, 8)).astype(np.float32)  # channels-last
    image_latents = None
    if i2v:
        image_latents = np.random.default_rng(4).standard_normal((1, 8, 1, *grid[1:])).astype(np.float32)
        x0[:, 0] = image_latents[:, :, 0].transpose(0, 2, 3, 1)
    kw = dict(seed=0, height=h, width=w, num_frames=frames, steps=steps, guidance=3.0, fps=24.0, guidance_rescale=0.7,
              image_latents=image_latents, latents=x0)
    ours = pipe.sample_latents(cond, cm, unc, um, **kw)
    cls = LTXImageToVideoPipeline if i2v else LTXPipeline
    ref = cls(scheduler=sched, vae=vae, text_encoder=None, tokenizer=None, transformer=dit)
    extra = dict(image=None) if i2v else {}
    with torch.no_grad():
        out = ref(prompt_embeds=torch.from_numpy(cond), prompt_attention_mask=torch.from_numpy(cm),
                  negative_prompt_embeds=torch.from_numpy(unc), negative_prompt_attention_mask=torch.from_numpy(um),
                  latents=torch.from_numpy(np.asarray(pack(x0))), height=h, width=w, num_frames=frames,
                  num_inference_steps=steps, guidance_scale=3.0, guidance_rescale=0.7, frame_rate=24,
                  output_type="latent", return_dict=False, **extra)[0]
    ref_lat = to_numpy(out).reshape(2, *grid, 8).transpose(0, 4, 1, 2, 3)
    assert_parity(ours, ref_lat, what=f"LTX {'I2V' if i2v else 'T2V'} latents after {steps} steps")
    if i2v:
        np.testing.assert_array_equal(ours[:, :, :1], np.broadcast_to(image_latents, (2, *image_latents.shape[1:])))


def test_decode_phase_matches_diffusers(folder):
    """Denormalise with the VAE's statistics and scaling factor, decode at decode_timestep (decode
    noise scale 0 here: the reference draws its noise from torch)."""
    from types import SimpleNamespace

    from vidax.models.ltx.ltxv import LTXVideo

    root, dit, vae, sched = folder
    pipe = LTXVideo(str(root))
    lat = np.random.default_rng(5).standard_normal((1, 8, 2, 2, 3)).astype(np.float32)
    req = SimpleNamespace(seed=0, options={"decode_timestep": 0.05, "decode_noise_scale": 0.0, "vae_tiling": False})
    px = pipe.decode_latents(lat, req)
    m, s = vae.latents_mean.view(1, -1, 1, 1, 1), vae.latents_std.view(1, -1, 1, 1, 1)
    with torch.no_grad():
        z = torch.from_numpy(lat) * s / vae.config.scaling_factor + m
        ref = to_numpy(vae.decode(z, torch.tensor([0.05])).sample)
    assert_parity(px, ref, what="LTX decode phase")


def test_prompt_encode_follows_the_masked_original_release(tmp_path):
    """LTX-Video's prompt encode runs T5 **with** its attention mask, as the original release and
    diffusers' ``LTXConditionPipeline`` do (the reference here); diffusers' ``LTXPipeline`` /
    ``LTXImageToVideoPipeline`` run it without the mask, so their embeddings of a padded prompt
    differ (the README says so)."""
    from types import SimpleNamespace

    import transformers
    from diffusers import LTXConditionPipeline, LTXPipeline

    from tests.test_t5 import _train_tokenizer_json
    from vidax.models.ltx.ltxv import LTXVideo

    _train_tokenizer_json(tmp_path / "tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    torch.manual_seed(0)
    enc = perturb(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=150, d_model=20, d_kv=8, d_ff=40, num_layers=2, num_heads=3, feed_forward_proj="gated-gelu")), seed=4)
    enc.save_pretrained(tmp_path / "text_encoder")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "LTXPipeline"}))
    prompts = ["a fox in snow", "dogs and cats and videos of foxes under the moon"]
    ref = SimpleNamespace(tokenizer=tok, text_encoder=enc)
    with torch.no_grad():
        masked, mask = LTXConditionPipeline._get_t5_prompt_embeds(ref, prompts, max_sequence_length=128, device="cpu",
                                                                  dtype=torch.float32)
        unmasked, _ = LTXPipeline._get_t5_prompt_embeds(ref, prompts, max_sequence_length=128, device="cpu",
                                                        dtype=torch.float32)
    got, got_mask = LTXVideo(str(tmp_path)).encode_prompts(prompts)
    np.testing.assert_array_equal(got_mask, mask.numpy().astype(np.float32))
    valid = mask.numpy().astype(bool)  # the DiT's cross-attention masks the padding out
    assert_parity(got, masked.numpy(), what="LTX prompt embeddings vs LTXConditionPipeline (masked T5)")
    gap = float(np.abs(got[valid] - unmasked.numpy()[valid]).max())
    print(f"LTXPipeline (unmasked T5) vs the masked encode: max abs difference {gap:.3e}")
    assert gap > 1e-2, f"the unmasked LTXPipeline encode is expected to differ on a padded prompt (gap {gap:.2e})"
