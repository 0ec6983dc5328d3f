"""End-to-end Wan text-to-video against diffusers' WanPipeline, and the tiny preset."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb

DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
           text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=64)
VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])


@pytest.fixture(scope="module")
def ref_pipeline(tmp_path_factory):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    transformer = perturb(WanTransformer3DModel(**DIT), seed=1)
    vae = perturb(AutoencoderKLWan(**VAE), seed=2)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=sched)
    folder = tmp_path_factory.mktemp("wan_pipe")
    pipe.save_pretrained(folder)
    return pipe, folder


def _inputs(b=1, lt=16, f=9, h=32, w=32, seed=0):
    rng = np.random.default_rng(seed)
    cond = rng.standard_normal((b, lt, DIT["text_dim"])).astype(np.float32)
    uncond = rng.standard_normal((b, lt, DIT["text_dim"])).astype(np.float32)
    lat = rng.standard_normal((b, 16, (f - 1) // 4 + 1, h // 8, w // 8)).astype(np.float32)
    return cond, uncond, lat


@pytest.mark.parametrize("steps,guidance", [(4, 5.0), (3, 1.0)])
def test_wan_pipeline_end_to_end(ref_pipeline, steps, guidance):
    from vidax.models.wan.pipeline import WanT2V

    pipe, folder = ref_pipeline
    cond, uncond, lat = _inputs()
    with torch.no_grad():
        ref = pipe(prompt_embeds=torch.from_numpy(cond), negative_prompt_embeds=torch.from_numpy(uncond),
                   latents=torch.from_numpy(lat), num_inference_steps=steps, guidance_scale=guidance,
                   height=32, width=32, num_frames=9, output_type="np").frames
        ref_lat = pipe(prompt_embeds=torch.from_numpy(cond), negative_prompt_embeds=torch.from_numpy(uncond),
                       latents=torch.from_numpy(lat), num_inference_steps=steps, guidance_scale=guidance,
                       height=32, width=32, num_frames=9, output_type="latent").frames.numpy()
    vx = WanT2V(folder)
    z = vx.sample_latents(cond, uncond if guidance > 1 else None, latents=lat, steps=steps, guidance=guidance)
    assert_parity(z, ref_lat, what=f"WanPipeline final latents ({steps} steps, guidance {guidance})")
    video = vx.decode_video(z)
    assert video.shape == ref.shape == (1, 9, 32, 32, 3)
    inside = float(np.mean((ref > 0.01) & (ref < 0.99)))
    assert inside > 0.5, f"only {inside:.0%} of reference pixels are unclamped; the comparison would be weak"
    assert_parity(video, ref, what=f"WanPipeline frames ({steps} steps, guidance {guidance})")


def test_checkpoint_on_a_usp_mesh_reads_only_shards(ref_pipeline, monkeypatch):
    """A real checkpoint folder on ``tp=2,sp=4`` (1 head per tp shard: a ring of 4; 12 tokens
    padded to 16): the DiT is placed straight from the file, each device reading only its slices
    (no transformer tensor read whole), and the latents are those of one device."""
    from vidax.models.wan.pipeline import WanT2V
    from vidax.weights.io import LazyTensor

    _, folder = ref_pipeline
    cond, uncond, lat = _inputs()
    one = WanT2V(folder).sample_latents(cond, uncond, latents=lat, steps=2, guidance=5.0)
    reads = []
    orig = LazyTensor.read
    monkeypatch.setattr(LazyTensor, "read", lambda self, index=None: reads.append((self.name, index)) or orig(self, index))
    usp = WanT2V(folder, mesh="tp=2,sp=4").sample_latents(cond, uncond, latents=lat, steps=2, guidance=5.0)
    dit = [r for r in reads if r[0].startswith("blocks.")]
    assert dit and all(index is not None for _, index in dit), "a transformer tensor was read whole"
    assert_parity(usp, one, what="Wan checkpoint on tp=2,sp=4 vs one device")


def test_tiny_preset_generates_deterministically():
    from vidax.models.wan.pipeline import WanT2V

    pipe = WanT2V("tiny")
    a = pipe.generate("a red panda", seed=3, height=32, width=48, num_frames=5, steps=2, guidance=3.0)
    b = pipe.generate("a red panda", seed=3, height=32, width=48, num_frames=5, steps=2, guidance=3.0)
    c = pipe.generate("a red panda", seed=4, height=32, width=48, num_frames=5, steps=2, guidance=3.0)
    assert a.shape == (1, 5, 32, 48, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert np.abs(a.astype(int) - c.astype(int)).mean() > 1.0


def test_prompt_embeddings_are_zero_past_the_prompt():
    from vidax.models.wan.pipeline import WanT2V

    pipe = WanT2V("tiny")
    e = pipe.encode_prompts(["short", "a much longer prompt with many more bytes in it"])
    n0 = len("short") + 1  # bytes + eos
    assert np.abs(e[0, :n0]).sum() > 0 and np.all(e[0, n0:] == 0)
    assert np.abs(e[1, n0:]).sum() > 0


@pytest.mark.parametrize("h,w,f,msg", [(30, 32, 9, "multiple of 16"), (32, 32, 8, r"4k\+1")])
def test_size_validation(h, w, f, msg):
    from vidax.models.wan.pipeline import WanT2V

    with pytest.raises(ValueError, match=msg):
        WanT2V("tiny").generate("x", height=h, width=w, num_frames=f, steps=1)


def test_original_release_folder_end_to_end(ref_pipeline, tmp_path):
    """The same run from a folder laid out like the original Wan2.1 release."""
    import json

    from vidax.models.wan import dit as wdit
    from vidax.models.wan import vae as wvae
    from vidax.models.wan.pipeline import WanT2V
    from vidax.weights import save_safetensors

    pipe, _ = ref_pipeline
    sd = {k: v.detach().numpy() for k, v in pipe.transformer.state_dict().items()}
    dcfg = wdit.WanDiTConfig.from_diffusers(dict(pipe.transformer.config))
    ren = wdit.diffusers_keymap(dcfg).rename(sd, wdit.original_keymap(dcfg))
    save_safetensors({ren[k]: v for k, v in sd.items()}, tmp_path / "diffusion_pytorch_model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "model_type": "t2v", "dim": 24, "ffn_dim": 48, "freq_dim": 32, "in_dim": 16,
        "out_dim": 16, "num_heads": 2, "num_layers": 2, "text_dim": 32, "text_len": 512, "eps": 1e-6}))
    vsd = pipe.vae.state_dict()
    vcfg = wvae.WanVAEConfig.from_diffusers(dict(pipe.vae.config))
    vren = wvae.diffusers_keymap(vcfg).rename(vsd, wvae.original_keymap(vcfg))
    torch.save({vren[k]: v for k, v in vsd.items()}, tmp_path / "Wan2.1_VAE.pth")

    cond, uncond, lat = _inputs(seed=5)
    with torch.no_grad():
        ref = pipe(prompt_embeds=torch.from_numpy(cond), negative_prompt_embeds=torch.from_numpy(uncond),
                   latents=torch.from_numpy(lat), num_inference_steps=3, guidance_scale=4.0,
                   height=32, width=32, num_frames=9, output_type="np").frames
    vx = WanT2V(tmp_path)
    assert vx.layout == "original"
    z = vx.sample_latents(cond, uncond, latents=lat, steps=3, guidance=4.0, scheduler=vx.scheduler(3, "unipc", shift=3.0))
    assert_parity(vx.decode_video(z), ref, what="original-release folder frames")


def test_stage_keys_follow_content_not_paths_or_mtimes(ref_pipeline, tmp_path):
    """The same checkpoint in two folders with different modification times gives the same stage
    keys; changing a weight changes the keys of the stages that use it."""
    import os
    import shutil

    from stages import run as R
    from stages.request import Request

    _, folder = ref_pipeline
    a, b = tmp_path / "copy-a", tmp_path / "copy-b"
    shutil.copytree(folder, a)
    shutil.copytree(folder, b)
    for i, f in enumerate(sorted(p for p in b.rglob("*") if p.is_file())):
        os.utime(f, (1_000_000 + i, 1_000_000 + i))

    def keys(path):  # (the fixture folder has no text encoder, so the request is not validated)
        req = Request(model="wan2.1-t2v-1.3b", checkpoint=str(path), prompt="x", height=32, width=32,
                      num_frames=5, steps=2, options={"scheduler": "unipc"}).resolved()
        return R.stage_keys(req, R.make_pipeline(req))

    ka, kb = keys(a), keys(b)
    assert ka == kb
    # flip one byte of the DiT's weights (inside the tensor data, past the header)
    st = sorted((b / "transformer").glob("*.safetensors"))[0]
    data = bytearray(st.read_bytes())
    data[-5] ^= 0x01
    st.write_bytes(bytes(data))
    kc = keys(b)
    assert kc["encode"] == ka["encode"] and kc["sample"] != ka["sample"]
    assert all(kc[s] != ka[s] for s in ka if s.startswith("decode/"))  # downstream of sample


def test_vae_tiling_option_through_the_stages(tmp_path, monkeypatch):
    """``--vae-tiling`` on a frame of several tiles (32-pixel tiles every 24 here, so a 32x64 frame
    has 2 x 3): the decode stages are 2 tile groups x 2 frame ranges, each carrying only its own
    tiles' caches from its group's previous range; mux blends their tiles into the in-memory tiled
    decode's video, bitwise; one tile stage rerun alone writes the same tiles and touches no other
    stage. A frame that one tile covers keeps the frame-range plan."""
    import time

    from stages import cli
    from stages import run as R
    from stages.request import Request, validate
    from stages.store import RunStore, read_array
    from vidax.models.wan import tiles as wtiles
    from vidax.models.wan import vae as wvae
    from vidax.pipeline import to_uint8, to_unit_range

    one = validate(Request(model="wan2.1-t2v-1.3b", prompt="a lighthouse", options={"vae_tiling": True}))
    assert all(s.tile is None for s in R.make_pipeline(one).decode_plan(one))
    monkeypatch.setattr(wtiles, "TILE", 32)
    monkeypatch.setattr(wtiles, "TILE_STRIDE", 24)
    req = validate(Request(model="wan2.1-t2v-1.3b", prompt="a lighthouse", steps=2, height=32, width=64,
                           num_frames=5, options={"vae_tiling": True}))
    url = f"file://{tmp_path}"
    run = RunStore(url).run("x")
    R.generate(run, req, log=lambda m: None)
    pipe = R.make_pipeline(req)
    plan = pipe.decode_plan(req)
    assert [(s.name, s.frames, s.tile, s.carry_from) for s in plan] == [
        ("decode/0", (0, 1), (0, 4, 0, 8), None), ("decode/1", (0, 1), (3, 4, 0, 8), None),
        ("decode/2", (1, 2), (0, 4, 0, 8), "decode/0"), ("decode/3", (1, 2), (3, 4, 0, 8), "decode/1")]
    carried = {s.name: {e[0].split("/")[0] for e in run.record(s.name)["details"].get("carry_index", [])}
               for s in plan}
    assert carried == {"decode/0": {"0", "1", "2"}, "decode/1": {"3", "4", "5"}, "decode/2": set(), "decode/3": set()}
    parts = [(s, read_array(run.group(f"{s.name}.zarr"), "frames")) for s in plan]
    # the tiles of 1 x (4, 4, 2) latents side by side: raw decoder output, blended by mux
    assert parts[1][1].shape == (1, 1, 8, (4 + 4 + 2) * 8, 3) and parts[1][1].dtype == np.float32
    params, cfg = pipe.load_vae()
    z = wvae.denormalize_latents(cfg, read_array(run.group("sample.zarr"), "latents"))
    want = to_uint8(to_unit_range(wtiles.tiled_decode(params, cfg, z)))
    np.testing.assert_array_equal(pipe.assemble_video(parts), want)
    assert run.record("mux")["status"] == "done"

    names = R.stage_names(req, pipe)
    finished = {s: run.record(s)["finished"] for s in names}
    run.delete("decode/2.zarr")
    time.sleep(1.1)
    assert cli.main(["rerun", "x", "--stage", "decode/2", "--store", url]) == 0
    assert [s for s in names if run.record(s)["finished"] != finished[s]] == ["decode/2"]
    np.testing.assert_array_equal(read_array(run.group("decode/2.zarr"), "frames"), parts[2][1])
