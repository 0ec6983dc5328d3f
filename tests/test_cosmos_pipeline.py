"""Cosmos-Predict2.5 end to end against diffusers' Cosmos2_5_PredictBasePipeline built from the same
tiny perturbed components: the text features (every layer normalised and concatenated; their scale),
the chat-formatted token ids, Text2World / Image2World / Video2World sampling (a few steps, CFG,
batch of two prompts) and the decoded frames; resume and the tiny preset."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import torch

from tests.cosmos_fixtures import predict25_folder
from tests.refutil import assert_parity, to_numpy
from vidax.models.cosmos import text as ctext
from vidax.models.cosmos.pipeline import CosmosPredict

H, W, F = 32, 48, 9  # 4 x 6 latent cells, 3 latent frames


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("predict25")
    ref = predict25_folder(folder)
    return ref, CosmosPredict(folder)


def _noise(b, seed=0):
    return np.random.default_rng(seed).standard_normal((b, 16, (F - 1) // 4 + 1, H // 8, W // 8)).astype(np.float32)


def test_chat_token_ids_match_apply_chat_template(setup):
    ref, pipe = setup
    tok, template, specials, side = pipe.load_tokenizer()
    prompts = ["A red panda paddles a canoe.", "robot arm, sparks"]
    ours = ctext.token_ids(tok, prompts, 64, template, specials, padding_side=side)
    for p, row in zip(prompts, ours):
        want = ref.tokenizer.apply_chat_template(ctext.conversation(p), tokenize=True, add_generation_prompt=False,
                                                 add_vision_id=False, max_length=64, truncation=True,
                                                 padding="max_length")
        want = want["input_ids"] if not isinstance(want, list) else want
        assert list(row) == list(want)


def test_text_features_and_their_scale(setup):
    """All L layers (not the embeddings), each standardised with the unbiased std, concatenated."""
    ref, pipe = setup
    prompts = ["A red panda paddles a canoe.", "shaky footage, motion blur"]
    want = to_numpy(ref._get_prompt_embeds(prompts, max_sequence_length=512, device="cpu", dtype=torch.float32))
    ours = pipe.encode_prompts(prompts)
    assert ours.shape == want.shape == (2, 512, 3 * 32)
    assert_parity(ours, want, what="Predict2.5 text features")
    blocks = ours.reshape(2, 512, 3, 32)
    np.testing.assert_allclose(blocks.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(blocks.std(-1, ddof=1), 1.0, atol=1e-5)  # unit scale per layer, every token
    # the same features from a 10x louder encoder: the conditioning scale does not move
    tok, template, specials, side = pipe.load_tokenizer()
    ids = ctext.token_ids(tok, prompts, 512, template, specials, padding_side=side)
    hs = np.asarray(pipe.load_text_encoder().hidden_states(jnp.asarray(ids)))
    np.testing.assert_allclose(np.asarray(ctext.normalize_concat(10.0 * hs)), ours, atol=1e-4)


def _ours(pipe, prompts, neg, guidance, latents, image=None, video=None, steps=3, **kw):
    cond = pipe.encode_prompts(prompts)
    uncond = pipe.encode_prompts([neg] * len(prompts)) if guidance > 1 else None
    cl = pipe.encode_conditioning(image=image, video=video, height=H, width=W, **kw)
    lat = pipe.sample_latents(cond, uncond, cond_latents=cl, latents=latents, height=H, width=W, num_frames=F,
                              steps=steps, guidance=guidance)
    return lat, None


def _ref(ref, prompts, guidance, latents, steps=3, **kw):
    out = ref(prompt=prompts, negative_prompt=None, height=H, width=W, num_frames=F, num_inference_steps=steps,
              guidance_scale=guidance, latents=torch.from_numpy(latents), output_type="latent", **kw)
    return to_numpy(out.frames), None


def test_text2world_parity_batch_two(setup):
    ref, pipe = setup
    prompts = ["A red panda paddles a canoe across a misty lake.", "The video captures a robot arm welding."]
    latents = _noise(2)
    want_lat, _ = _ref(ref, prompts, 3.0, latents)
    lat, _ = _ours(pipe, prompts, ctext.DEFAULT_NEGATIVE_PROMPT, 3.0, latents)
    assert_parity(lat, want_lat, what="Text2World latents (3 steps, CFG 3, B=2)")
    # decode as the reference does (latents / (1 / std) + mean, AutoencoderKLWan.decode, postprocess);
    # one latent frame keeps the torch decode short (the whole-clip decode is tested with the Wan VAE)
    z = torch.from_numpy(want_lat[:, :, :1])
    z = z / ref.latents_std + ref.latents_mean
    with torch.no_grad():
        want_px = ref.video_processor.postprocess_video(ref.vae.decode(z, return_dict=False)[0], output_type="np")
    assert_parity(pipe.decode_video(lat[:, :, :1]), np.asarray(want_px), what="decoded frame (Wan2.1 VAE)")


def test_image2world_parity(setup):
    ref, pipe = setup
    rng = np.random.default_rng(5)
    img = (rng.random((45, 70, 3)) * 255).astype(np.uint8)  # non-square, resized to 32x48 (nearest)
    latents = _noise(1, seed=2)
    want_lat, _ = _ref(ref, ["the canoe drifts"], 4.0, latents, image=PIL.Image.fromarray(img))
    lat, _ = _ours(pipe, ["the canoe drifts"], ctext.DEFAULT_NEGATIVE_PROMPT, 4.0, latents, image=img)
    assert_parity(lat, want_lat, what="Image2World latents")


def test_video2world_parity(setup, cond_frames=2):
    ref, pipe = setup
    rng = np.random.default_rng(6)
    clip = (rng.random((7, 36, 60, 3)) * 255).astype(np.uint8)  # bilinear PIL resize to 32x48
    latents = _noise(1, seed=3)
    want_lat, _ = _ref(ref, ["sparks fly"], 3.0, latents, video=[PIL.Image.fromarray(f) for f in clip],
                       num_latent_conditional_frames=cond_frames)
    lat, _ = _ours(pipe, ["sparks fly"], ctext.DEFAULT_NEGATIVE_PROMPT, 3.0, latents, video=clip,
                   cond_frames=cond_frames)
    assert_parity(lat, want_lat, what=f"Video2World latents ({cond_frames} fixed latent frames)")


def test_no_guidance_and_resume_bitwise(setup):
    """guidance <= 1: one pass per step, no negative prompt; a run split at step 2 equals one that
    never stopped."""
    ref, pipe = setup
    latents = _noise(1, seed=4)
    want_lat, _ = _ref(ref, ["a lake"], 1.0, latents, steps=4)
    cond = pipe.encode_prompts(["a lake"])
    full = pipe.sample_latents(cond, None, latents=latents, height=H, width=W, num_frames=F, steps=4, guidance=1.0)
    assert_parity(full, want_lat, what="Text2World without guidance")
    saved = {}

    def keep(info, x, state):
        if info.index == 1:
            saved["x"], saved["state"] = np.asarray(x).transpose(0, 4, 1, 2, 3), state

    pipe.sample_latents(cond, None, latents=latents, height=H, width=W, num_frames=F, steps=4, guidance=1.0,
                        on_step=keep)
    resumed = pipe.sample_latents(cond, None, latents=saved["x"], start=2, state=saved["state"], height=H, width=W,
                                  num_frames=F, steps=4, guidance=1.0)
    np.testing.assert_array_equal(resumed, full)


def test_video2world_option_through_the_protocol(setup, tmp_path):
    """``--video`` is a declared option read by the encode stage; its content digest enters the
    encode key; bad combinations are refused before anything runs."""
    from types import SimpleNamespace

    from vidax.pipeline import OptionError
    from vidax.video import write_mp4

    clip = tmp_path / "clip.mp4"
    write_mp4((np.random.default_rng(0).random((7, 48, 64, 3)) * 255).astype(np.uint8), clip, fps=8)
    pipe = setup[1]
    req = SimpleNamespace(model="cosmos2.5-2b", prompts=["sparks fly"], negative_prompt="", height=H, width=W,
                          num_frames=F, dtype="float32", image=None,
                          options={"video": str(clip), "cond_frames": 2, "cond_timestep": 1e-4})
    pipe.check(req)
    out = pipe.encode(req)
    assert out["cond_latents"].array.shape == (1, 16, 2, H // 8, W // 8)
    assert len(pipe.stage_params("encode", req)["video_digest"]) == 20
    with pytest.raises(OptionError, match="^video: give either"):
        pipe.check(SimpleNamespace(**{**req.__dict__, "image": "x.png"}))
    short = tmp_path / "short.mp4"
    write_mp4((np.random.default_rng(1).random((3, 48, 64, 3)) * 255).astype(np.uint8), short, fps=8)
    with pytest.raises(OptionError, match="needs at least 5"):
        pipe.check(SimpleNamespace(**{**req.__dict__, "options": {**req.options, "video": str(short)}}))
