"""Cosmos3 end to end against diffusers' Cosmos3OmniPipeline built from the same tiny perturbed
components: the tokenized prompts (chat template, system prompts, metadata sentences and their
inverses, eos + <|vision_start|>), the image / video conditioning latents, text-to-video, image- and
video-conditioned sampling (CFG, a few steps), two prompts at once; the prompt formatter and the
Edge short-prompt warning."""
from __future__ import annotations

import json
import warnings

import numpy as np
import PIL.Image
import pytest
import torch

from tests.cosmos_fixtures import cosmos3_folder
from tests.refutil import assert_parity, to_numpy
from vidax.models.cosmos3 import prompt as cprompt
from vidax.models.cosmos3.pipeline import Cosmos3Omni

H, W, F, FPS = 48, 80, 9, 16.0  # latent 3 x 5 (odd: padded to the 2x2 patches), 3 latent frames


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cosmos3")
    ref = cosmos3_folder(folder)
    return ref, Cosmos3Omni(folder)


def _noise(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 8, 3, H // 16, W // 16)).astype(np.float32)


@pytest.mark.parametrize("num_frames,system", [(F, None), (1, False)])
def test_tokenized_prompts_match(setup, num_frames, system):
    ref, pipe = setup
    want = ref.tokenize_prompt("a red panda paddles a canoe.", "blurry", num_frames=num_frames, height=H, width=W,
                               fps=FPS, use_system_prompt=system)
    cond, uncond = pipe.tokenize(["a red panda paddles a canoe."], "blurry", num_frames=num_frames, height=H,
                                 width=W, fps=FPS, system_prompt=system)
    assert cond[0] == list(want[0]) and uncond[0] == list(want[1])


def _ref_latents(ref, prompt, neg, guidance, latents, steps=3, **kw):
    out = ref(prompt=prompt, negative_prompt=neg, num_frames=F, height=H, width=W, fps=FPS, num_inference_steps=steps,
              guidance_scale=guidance, latents=torch.from_numpy(latents), output_type="latent", **kw)
    return to_numpy(out.video)


def _ours(pipe, prompts, neg, guidance, latents, steps=3, cond_latents=None):
    cond, uncond = pipe.tokenize(prompts, neg, num_frames=F, height=H, width=W, fps=FPS)
    return pipe.sample_latents(cond, uncond, cond_latents=cond_latents, latents=latents, height=H, width=W,
                               num_frames=F, steps=steps, guidance=guidance, fps=FPS)


def test_text2video_parity(setup):
    ref, pipe = setup
    latents = _noise()
    want = _ref_latents(ref, "a red panda paddles a canoe.", "blurry", 4.0, latents)
    assert_parity(_ours(pipe, ["a red panda paddles a canoe."], "blurry", 4.0, latents), want,
                  what="Cosmos3 text-to-video latents (3 steps, CFG 4)")


def test_two_prompts_at_once(setup):
    """Two prompts of different token lengths in one batch (text padded and masked) equal two runs."""
    ref, pipe = setup
    prompts = ["a red panda paddles a canoe across a misty lake at dawn.", "sparks"]
    lat = np.concatenate([_noise(1), _noise(2)])
    ours = _ours(pipe, prompts, "", 3.0, lat)
    for b, p in enumerate(prompts):
        want = _ref_latents(ref, p, None, 3.0, lat[b:b + 1])
        assert_parity(ours[b:b + 1], want, what=f"batched prompt {b}")


def test_image2video_parity(setup):
    ref, pipe = setup
    img = (np.random.default_rng(5).random((41, 97, 3)) * 255).astype(np.uint8)  # cover + centre crop
    cl = pipe.encode_conditioning(image=img, height=H, width=W, num_frames=F)
    x = ref.prepare_latents(image=PIL.Image.fromarray(img), num_frames=F, height=H, width=W, fps=FPS,
                            generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32)
    ref_latents, mask = to_numpy(x[0]), to_numpy(x[5])
    assert mask[:, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert_parity(cl[:, :, 0], ref_latents[:, :, 0], what="Cosmos3 image conditioning latent")
    start = ref_latents.copy()  # the reference's own mix of the image latent and its noise
    want = _ref_latents(ref, "the canoe drifts", "blurry", 4.0, start, image=PIL.Image.fromarray(img))
    assert_parity(_ours(pipe, ["the canoe drifts"], "blurry", 4.0, start, cond_latents=cl), want,
                  what="Cosmos3 image-to-video latents")


def test_video2video_conditioning(setup):
    ref, pipe = setup
    clip = (np.random.default_rng(6).random((7, 40, 60, 3)) * 255).astype(np.uint8)
    cl = pipe.encode_conditioning(video=clip, height=H, width=W, num_frames=F, cond_frames=2)
    x = ref.prepare_latents(video=[PIL.Image.fromarray(f) for f in clip], num_frames=F, height=H, width=W, fps=FPS,
                            generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32)
    assert to_numpy(x[5])[:, 0, 0].tolist() == [1.0, 1.0, 0.0]
    assert_parity(cl, to_numpy(x[0])[:, :, :2], what="Cosmos3 video conditioning (first frames)")
    # "last": the same frames taken from the clip's end
    np.testing.assert_array_equal(pipe.encode_conditioning(video=clip, height=H, width=W, num_frames=F, keep="last"),
                                  pipe.encode_conditioning(video=clip[-5:], height=H, width=W, num_frames=F))
    start = to_numpy(x[0])
    want = _ref_latents(ref, "sparks fly", "", 3.0, start, video=[PIL.Image.fromarray(f) for f in clip])
    assert_parity(_ours(pipe, ["sparks fly"], "", 3.0, start, cond_latents=cl), want, what="Cosmos3 video-to-video")


def test_prompt_format_and_edge_warning():
    p = cprompt.format_prompt(
        "At 0:00, a red bus waits at a snowy intersection. At 0:03, the light turns green and it pulls away.",
        num_frames=121, fps=24, height=480, width=832,
        subjects=[cprompt.Subject("a red double-decker bus", location="center", action="drives forward")],
        background_setting="a snowy city street at dusk", lighting={"conditions": "warm streetlights"},
        cinematography=cprompt.Cinematography(camera_motion="Static", framing="wide"),
        actions=[("0:03-0:05", "the bus pulls away")])
    doc = json.loads(p)
    assert list(doc)[:2] == ["temporal_caption", "audio_description"]
    assert doc["duration"] == "0:05" and doc["fps"] == 24 and doc["resolution"] == {"W": 832, "H": 480}
    assert doc["aspect_ratio"] == "16,9" and doc["lighting"]["conditions"] == "warm streetlights"
    assert doc["subjects"][0]["number_of_subjects"] == 1 and doc["cinematography"]["framing"] == "wide"
    with pytest.raises(ValueError, match="ends after the clip"):
        cprompt.format_prompt("At 0:00, x.", num_frames=25, fps=24, height=480, width=832, actions=[("0:00-0:09", "y")])
    assert cprompt.is_structured(p) and cprompt.is_structured("```json\n{\"a\": 1}\n```")
    assert not cprompt.is_structured("a cat") and not cprompt.is_structured("[1, 2]")
    assert cprompt.short_prompt_warning("a red panda in a canoe") is not None
    assert cprompt.short_prompt_warning(p) is None and cprompt.short_prompt_warning("word " * 80) is None
    edge, nano = Cosmos3Omni("tiny-edge"), Cosmos3Omni("tiny")
    assert edge.warn_short_prompts and not nano.warn_short_prompts
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert edge.warn_prompts(["a red panda in a canoe", p]) and not nano.warn_prompts(["a red panda in a canoe"])
    assert [x.category for x in w] == [cprompt.ShortPromptWarning]
    assert "flat, oversaturated" in str(w[0].message) and "format_prompt" in str(w[0].message)
