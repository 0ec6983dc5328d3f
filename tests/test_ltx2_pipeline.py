"""LTX-2 pipelines against diffusers' ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline``: a few steps from
the same text-encoder hidden states (through the connectors), initial video and audio noise give the
same video and audio latents under the full guidance (CFG per stream, spatio-temporal, modality
isolation, rescale); the decode phase (video VAE, audio VAE + vocoder) equals the reference's. And
through the stages: an mp4 whose AAC track decodes to the video's duration; ``audio=false`` skips
the audio stage; tp / sp / offload equal one device."""
import json
import re
import subprocess
import warnings

import numpy as np
import pytest
import torch

from tests import sweep
from tests.refutil import assert_parity, perturb, to_numpy

DIT = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=4, cross_attention_dim=16,
           audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
           audio_cross_attention_dim=16, num_layers=2, caption_channels=16, rope_type="split", perturbed_attn=True)
CONN = dict(caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=4,
            audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=4, rope_type="split")
VAE = dict(latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 32),
           layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), decoder_causal=False,
           spatial_compression_ratio=32, temporal_compression_ratio=8)
AVAE = dict(base_channels=16, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4, mel_bins=16, resolution=16)
VOC = dict(in_channels=32, hidden_channels=16, upsample_kernel_sizes=[7, 4, 4], upsample_factors=[5, 4, 4],
           resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], output_sampling_rate=8000)
SCHED = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
             base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
GUIDE = dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=0.5, modality_scale=3.0,
             audio_modality_scale=2.0, guidance_rescale=0.7, audio_guidance_rescale=0.5, spatio_temporal_guidance_blocks=[1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    root = tmp_path_factory.mktemp("ltx2_pipe")
    torch.manual_seed(0)
    parts = dict(transformer=perturb(LTX2VideoTransformer3DModel(**DIT), seed=1),
                 connectors=perturb(LTX2TextConnectors(**CONN), seed=2), vae=perturb(AutoencoderKLLTX2Video(**VAE), seed=3),
                 audio_vae=perturb(AutoencoderKLLTX2Audio(**AVAE), seed=4), vocoder=perturb(LTX2Vocoder(**VOC), seed=5))
    with torch.no_grad():
        for name in ("vae", "audio_vae"):
            parts[name].latents_mean.add_(0.1 * torch.randn(parts[name].latents_mean.shape))
            parts[name].latents_std.add_(0.1 * torch.rand(parts[name].latents_std.shape))
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(**SCHED)
    for name, mod in parts.items():
        mod.save_pretrained(root / name)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "LTX2Pipeline"}))
    return root, parts


def _hidden(b, seed):
    """Stand-in text-encoder hidden states of every layer [B, T, D*(L+1)] + left-padded masks."""
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((b, 8, 16, 3)) * np.array([1.0, 20.0, 100.0])).astype(np.float32).reshape(b, 8, 48)
    m = np.ones((b, 8), np.int64)
    m[-1, :3] = 0
    return h, m


@pytest.mark.parametrize("i2v", [False, True])
def test_sampling_matches_diffusers(folder, i2v):
    import jax.numpy as jnp
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline

    from vidax.models.ltx.common import pack
    from vidax.models.ltx.ltx2 import LTX2

    root, parts = folder
    h_, w_, frames, steps, fps = 64, 96, 9, 3, 12.0
    pipe = LTX2(str(root), image_to_video=i2v)
    ch, cm = _hidden(2, 0)
    uh, um = _hidden(2, 1)
    conn = pipe.load_connectors()
    enc = lambda h, m: {k: np.asarray(v) for k, v in zip(("v", "a", "mask"), conn(jnp.asarray(h), jnp.asarray(m)))}  # noqa: E731
    cond, unc = enc(ch, cm), enc(uh, um)
    grid = pipe.latent_grid(h_, w_, frames)
    la = pipe.audio_frames(frames, fps)
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((2, *grid, 8)).astype(np.float32)
    a0 = rng.standard_normal((2, la, 16)).astype(np.float32)
    image_latents = None
    if i2v:
        image_latents = rng.standard_normal((1, 8, 1, *grid[1:])).astype(np.float32)
        x0[:, 0] = image_latents[:, :, 0].transpose(0, 2, 3, 1)
    opts = dict(audio_guidance=7.0, stg_scale=1.0, audio_stg_scale=0.5, stg_blocks="1", modality_scale=3.0,
                audio_modality_scale=2.0, guidance_rescale=0.7, audio_guidance_rescale=0.5, use_cross_timestep=True)
    v, a = pipe.sample_latents(cond, unc, seed=0, height=h_, width=w_, num_frames=frames, steps=steps, guidance=3.0,
                               fps=fps, options=opts, image_latents=image_latents, latents=x0, audio_latents=a0)
    av = parts["audio_vae"]
    raw_audio = a0 * av.latents_std.numpy() + av.latents_mean.numpy()  # the reference normalises given audio latents
    cls = LTX2ImageToVideoPipeline if i2v else LTX2Pipeline
    ref = cls(scheduler=parts["scheduler"], vae=parts["vae"], audio_vae=av, text_encoder=None, tokenizer=None,
              connectors=parts["connectors"], transformer=parts["transformer"], vocoder=parts["vocoder"])
    t = torch.from_numpy
    vae = parts["vae"]
    mean, std = vae.latents_mean.numpy().reshape(1, -1, 1, 1, 1), vae.latents_std.numpy().reshape(1, -1, 1, 1, 1)
    # T2V takes packed latents as they are; I2V takes them unpacked and raw (it normalises them)
    given = np.asarray(pack(x0)) if not i2v else x0.transpose(0, 4, 1, 2, 3) * std / vae.config.scaling_factor + mean
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        rv, ra = ref(prompt_embeds=t(ch), prompt_attention_mask=t(cm), negative_prompt_embeds=t(uh),
                     negative_prompt_attention_mask=t(um), latents=t(np.ascontiguousarray(given, np.float32)),
                     audio_latents=t(raw_audio),
                     height=h_, width=w_, num_frames=frames, frame_rate=fps, num_inference_steps=steps,
                     output_type="latent", return_dict=False, **({"image": None} if i2v else {}), **GUIDE)
    ours_v = v * std / vae.config.scaling_factor + mean
    assert_parity(ours_v, to_numpy(rv), what=f"LTX-2 {'I2V' if i2v else 'T2V'} video latents after {steps} steps")
    ours_a = (a * av.latents_std.numpy() + av.latents_mean.numpy()).reshape(2, la, 4, 4).transpose(0, 2, 1, 3)
    assert_parity(ours_a, to_numpy(ra), what=f"LTX-2 {'I2V' if i2v else 'T2V'} audio latents after {steps} steps")


def test_decode_phases_match_diffusers(folder):
    from types import SimpleNamespace

    from vidax.models.ltx.ltx2 import LTX2

    root, parts = folder
    pipe = LTX2(str(root))
    rng = np.random.default_rng(5)
    lat = rng.standard_normal((1, 8, 2, 2, 3)).astype(np.float32)
    alat = rng.standard_normal((1, 7, 16)).astype(np.float32)
    req = SimpleNamespace(seed=0, options={"decode_timestep": 0.0, "vae_tiling": False, "vae_decoder": "vae"})
    vae, av = parts["vae"], parts["audio_vae"]
    with torch.no_grad():
        z = torch.from_numpy(lat) * vae.latents_std.view(1, -1, 1, 1, 1) + vae.latents_mean.view(1, -1, 1, 1, 1)
        ref_px = to_numpy(vae.decode(z).sample)
        za = (torch.from_numpy(alat) * av.latents_std + av.latents_mean).unflatten(2, (4, 4)).transpose(1, 2)
        ref_wav = to_numpy(parts["vocoder"](av.decode(za).sample))
    assert_parity(pipe.decode_latents(lat, req), ref_px, what="LTX-2 video decode phase")
    wav = pipe.decode_audio(alat)
    assert_parity(wav, ref_wav, what="LTX-2 audio decode phase (audio VAE + vocoder)")
    assert pipe.audio_sample_rate() == 8000


def test_mp4_has_a_sound_track_of_the_video_length(tmp_path):
    import imageio_ffmpeg

    from stages import cli
    from stages import run as R
    from stages.store import RunStore

    url = f"file://{tmp_path}"
    args = ["generate", "--model", "ltx2-t2v", "--prompt", "rain on a tin roof", "--frames", "9", "--steps", "2",
            "--fps", "8", "--store", url]
    assert cli.main(args + ["--run-id", "av"]) == 0
    run = RunStore(url).run("av")
    req = R.load_request(run)
    assert "decode/audio" in R.stage_names(req)
    wav = run.group("decode/audio.zarr")["waveform"]
    assert wav.attrs["sample_rate"] == 8000 and wav.metadata.dimension_names == ("batch", "channel", "sample")
    mp4 = tmp_path / "runs/av/video.mp4"
    ff = imageio_ffmpeg.get_ffmpeg_exe()
    info = subprocess.run([ff, "-i", str(mp4)], capture_output=True, text=True).stderr
    assert re.search(r"Stream #0:\d.*Audio: aac", info), info
    pcm = subprocess.run([ff, "-v", "error", "-i", str(mp4), "-vn", "-f", "s16le", "-ac", "1", "-ar", "8000", "-"],
                         capture_output=True).stdout
    seconds = len(pcm) / 2 / 8000
    print(f"audio track: {seconds:.3f} s for {9 / 8:.3f} s of video")
    assert abs(seconds - 9 / 8) < 0.1 and np.abs(np.frombuffer(pcm, np.int16)).max() > 0
    # video only, and LTX-2.5's diffusion decoder chosen for this run
    assert cli.main(args + ["--audio", "false", "--vae-decoder", "diffusion", "--run-id", "silent"]) == 0
    silent = R.load_request(RunStore(url).run("silent"))
    assert "decode/audio" not in R.stage_names(silent)
    assert RunStore(url).run("silent").group("decode/0.zarr")["frames"].attrs["decoder"] == "diffusion"
    info = subprocess.run([ff, "-i", str(tmp_path / "runs/silent/video.mp4")], capture_output=True, text=True).stderr
    assert "Audio:" not in info


@pytest.mark.parametrize("mesh,chunk", sweep.sample([("tp=2", None), ("sp=2", None), ("dp=2,tp=2,sp=2", None), ("tp=2,sp=2", 1)],
                                                2, "ltx2-meshes"))
def test_scale_equals_one_device(folder, mesh, chunk):
    """The audio+video DiT on a mesh (video tokens over sp, audio replicated; heads and FFNs over
    tp) and with offloaded blocks equals one device, per-token (I2V) timesteps and STG included."""
    from vidax import compat

    root, parts = folder
    rng = np.random.default_rng(0)
    b, s, la = 2, 2 * 2 * 4, 5
    kw = dict(hidden_states=rng.standard_normal((b, s, 8)).astype(np.float32),
              audio_hidden_states=rng.standard_normal((b, la, 16)).astype(np.float32),
              encoder_hidden_states=rng.standard_normal((b, 6, 16)).astype(np.float32),
              audio_encoder_hidden_states=rng.standard_normal((b, 6, 16)).astype(np.float32),
              timestep=np.concatenate([np.zeros((b, 8)), np.full((b, 8), 600.0)], 1).astype(np.float32),
              audio_timestep=np.array([600.0, 200.0], np.float32), sigma=np.array([600.0, 200.0], np.float32),
              num_frames=2, height=2, width=4, audio_num_frames=la, use_cross_timestep=True,
              spatio_temporal_guidance_blocks=[0], perturbation_mask=np.array([1.0, 0.0], np.float32))
    one = compat.load_pretrained(root / "transformer").forward(**kw)
    out = compat.load_pretrained(root / "transformer", mesh=mesh, offload_chunk_size=chunk).forward(**kw)
    for o, r, what in zip(out, one, ("video", "audio")):
        err = float(np.max(np.abs(o - r)) / np.max(np.abs(r)))
        print(f"mesh={mesh} offload={chunk} {what}: rel err {err:.2e}")
        assert err <= 1e-5


@pytest.mark.parametrize("mesh,chunk", [("tp=2", 1), ("sp=2", None)])
def test_pipeline_sampling_on_a_mesh(mesh, chunk):
    """The tiny preset's sampling (full guidance, image-to-video) on a mesh / with offloaded blocks
    (the guidance passes then run from Python) equals one device; one compiled step program."""
    from vidax.core.jit import CompileCounter
    from vidax.models.ltx.ltx2 import LTX2

    rng = np.random.default_rng(0)
    emb = lambda s: {"v": rng.standard_normal((1, 64, 32)).astype(np.float32), "a": rng.standard_normal((1, 64, 32)).astype(np.float32), "mask": np.ones((1, 64), np.float32)}  # noqa: E501,E731
    cond, unc = emb(0), emb(1)
    img = rng.standard_normal((1, 8, 1, 2, 3)).astype(np.float32)
    kw = dict(seed=3, height=64, width=96, num_frames=9, steps=3, guidance=3.0, fps=8.0, image_latents=img,
              options={"stg_blocks": "1"})
    ref_v, ref_a = LTX2("tiny").sample_latents(cond, unc, **kw)
    seen = []
    with CompileCounter() as cc:
        v, a = LTX2("tiny", mesh=mesh, offload_chunk_size=chunk).sample_latents(
            cond, unc, on_step=lambda info, x, aa: seen.append(cc.count), **kw)
    for o, r, what in ((v, ref_v, "video"), (a, ref_a, "audio")):
        err = float(np.max(np.abs(o - r)) / np.max(np.abs(r)))
        print(f"{mesh} offload={chunk} {what}: rel err {err:.2e}")
        assert err <= 1e-5
    assert seen[-1] == seen[0], f"recompiled after the first step: {seen}"
