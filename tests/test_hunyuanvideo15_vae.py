"""HunyuanVideo 1.5 VAE: parity with diffusers' AutoencoderKLHunyuanVideo15 (decode, encode
posterior mean, tiled decode and tiled encode with the reference's tile settings), the staged
decode of frame ranges, the original release's names."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.models.hunyuanvideo15 import vae as hvae
from vidax.weights import save_safetensors

# three levels, 4x spatial / 4x temporal (both temporal resamplers, the first frame's special case)
TINY = dict(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1, spatial_compression_ratio=4,
            temporal_compression_ratio=4)
TILE = dict(tile_sample_min_height=16, tile_sample_min_width=16, tile_latent_min_height=4, tile_latent_min_width=4,
            tile_overlap_factor=0.25)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    m = perturb(AutoencoderKLHunyuanVideo15(**TINY), seed=3)
    folder = tmp_path_factory.mktemp("hv15_vae")
    m.save_pretrained(folder)
    rng = np.random.default_rng(0)
    # tiled: 7x7 latents in 4-latent tiles every 3 (edge tiles of 1, both directions blended); the
    # whole-frame decode uses the first tile's shape (one compile per tile shape and decoder level)
    zt = rng.standard_normal((2, 4, 3, 7, 7)).astype(np.float32)
    z = np.ascontiguousarray(zt[..., :4, :4])
    x = rng.uniform(-1, 1, (2, 3, 5, 16, 16)).astype(np.float32)
    xt = rng.uniform(-1, 1, (2, 3, 5, 16, 28)).astype(np.float32)  # 16-px tiles every 12 across
    # the reference's mid-block attention mask only broadcasts for batch 1 ([B, L, L] against
    # [B, 1, L, L]): its B=2 output is its two B=1 outputs
    dec_ = lambda a: np.concatenate([to_numpy(m.decode(torch.from_numpy(a[i:i + 1])).sample) for i in range(len(a))])  # noqa: E731
    enc_ = lambda a: np.concatenate([to_numpy(m.encode(torch.from_numpy(a[i:i + 1])).latent_dist.mode())  # noqa: E731
                                     for i in range(len(a))])
    with torch.no_grad():
        dec, enc = dec_(z), enc_(x)
        m.enable_tiling(**TILE)
        dec_t, enc_t = dec_(zt), enc_(xt)
    return dict(model=m, folder=folder, z=z, x=x, zt=zt, xt=xt, dec=dec, enc=enc, dec_t=dec_t, enc_t=enc_t)


def test_decode_encode_parity(ref):
    vae = compat.load_pretrained(ref["folder"])
    assert_parity(vae.decode(ref["z"]), ref["dec"], what="AutoencoderKLHunyuanVideo15 decode")
    assert_parity(vae.encode(ref["x"]), ref["enc"], what="AutoencoderKLHunyuanVideo15 encode")


def test_tiled_parity(ref):
    vae = compat.load_pretrained(ref["folder"])
    vae.enable_tiling(**TILE)
    assert_parity(vae.decode(ref["zt"]), ref["dec_t"], what="AutoencoderKLHunyuanVideo15 tiled decode")
    assert_parity(vae.encode(ref["xt"]), ref["enc_t"], what="AutoencoderKLHunyuanVideo15 tiled encode")


def test_frame_ranges_concatenate_to_decode(ref):
    """Causal decoder: the frames of latent ranges [0, 1), [1, 3) are the whole decode's, bitwise
    when cut from whole decodes, to float error when decoded from their prefix alone. The staged
    decoder: a new shape builds exactly one program per decoder level, the same shape none."""
    from vidax.core.jit import CompileCounter

    vae = hvae.load_vae(ref["folder"])
    whole = hvae.decode(vae, ref["z"])
    parts = [hvae.decode_frames(vae, ref["z"], a, b) for a, b in ((0, 1), (1, 3))]
    assert [p.shape[2] for p in parts] == [1, 8]
    np.testing.assert_array_equal(np.concatenate(parts, axis=2), whole)
    with CompileCounter() as cc:
        first = hvae.decode_frames(vae, ref["z"], 0, 2, prefix_only=True)
    assert cc.count == len(TINY["block_out_channels"]) + 2
    assert_parity(first, ref["dec"][:, :, :5], what="decode of the causal prefix [0, 2)")
    with CompileCounter() as cc:
        hvae.decode_frames(vae, ref["z"] + 1, 0, 2, prefix_only=True)
    assert cc.count == 0


def test_original_release_names(ref, tmp_path):
    sd = {k: to_numpy(v) for k, v in ref["model"].state_dict().items()}
    inv = {}
    for k, v in sd.items():
        o = (k.replace("down_blocks.", "down.").replace("up_blocks.", "up.").replace(".resnets.", ".block.")
             .replace("downsamplers.0", "downsample").replace("upsamplers.0", "upsample")
             .replace("mid_block.block.0", "mid.block_1").replace("mid_block.block.1", "mid.block_2")
             .replace("mid_block.attentions.0.to_", "mid.attn_1.").replace("mid_block.attentions.0", "mid.attn_1"))
        inv[o] = v
    assert "encoder.mid.attn_1.q.weight" in inv and "decoder.up.0.upsample.conv.conv.weight" in inv
    save_safetensors(inv, tmp_path / "diffusion_pytorch_model.safetensors")
    vae = hvae.load_vae(tmp_path / "diffusion_pytorch_model.safetensors", hvae.HunyuanVideo15VAEConfig(**TINY))
    assert_parity(hvae.decode(vae, ref["z"]), ref["dec"], what="decode from the original names")



@pytest.fixture(scope="module")
def long_ref(ref):
    """7 latent frames (25 video frames), non-square 5x6 latents: the reference's decode, B=2 as two B=1."""
    z = np.random.default_rng(5).standard_normal((2, 4, 7, 5, 6)).astype(np.float32)
    m = ref["model"]
    m.use_tiling = False  # (the module's reference has tiling on)
    try:
        with torch.no_grad():
            dec = np.concatenate([to_numpy(m.decode(torch.from_numpy(z[i:i + 1])).sample) for i in range(2)])
    finally:
        m.use_tiling = True
    return z, dec


def test_chunked_decode_parity(ref, long_ref):
    """Temporal chunks carrying the causal state (conv inputs, the mid attention's keys/values)
    equal the reference's all-frames decode: chunks of 2 (the last one padded) and of 3; two
    programs per decoder level (the first chunk, every later one), none on a second call; frame
    ranges decoded from their chunked prefix equal the chunked whole decode bitwise."""
    from vidax.core.jit import CompileCounter

    vae = hvae.load_vae(ref["folder"])
    z, want = long_ref
    levels = len(TINY["block_out_channels"]) + 2
    with CompileCounter() as cc:
        got = hvae.decode(vae, z, chunk=2)
    assert cc.count == 2 * levels
    assert got.shape == want.shape == (2, 3, 25, 20, 24)
    assert_parity(got, want, what="chunked decode (2 latent frames per call)")
    with CompileCounter() as cc:
        again = hvae.decode(vae, z + 0.5, chunk=2)
    assert cc.count == 0 and not np.array_equal(again, got)
    parts = [hvae.decode_frames(vae, z, a, b, prefix_only=True, chunk=2) for a, b in ((0, 2), (2, 5), (5, 7))]
    np.testing.assert_array_equal(np.concatenate(parts, axis=2), got)


def test_staged_tile_decode(ref):
    """The pipeline's tiled decode stages (the tiny tile settings of the module's reference: 7x7
    latents, 3x3 tiles with edge tiles of 1; every frame per call -- the chunks are checked above and
    run tiled in the registry conformance test): one stage per reference
    tile, each persisting its raw decode; the assembled video is the reference's tiled decode
    (cross-fade included) and, bitwise, the in-memory tiled decode; a tile decoded again
    alone (a rerun) is the same bytes."""
    from types import SimpleNamespace

    from vidax.models.hunyuanvideo15.pipeline import HunyuanVideo15T2V
    from vidax.pipeline import to_uint8, to_unit_range

    vae = hvae.load_vae(ref["folder"])
    p = HunyuanVideo15T2V("tiny")
    p.load_vae = lambda: vae
    p.tiling = lambda enabled=True: hvae.Tiling(bool(enabled), TILE["tile_sample_min_height"],
                                                TILE["tile_latent_min_height"], TILE["tile_overlap_factor"])
    req = SimpleNamespace(height=28, width=28, num_frames=9, options={"vae_tiling": True, "vae_chunk": 0},
                          decode_stages=None)
    plan = p.decode_plan(req)
    assert [s.tile for s in plan] == [(y, min(y + 4, 7), x, min(x + 4, 7)) for y in (0, 3, 6) for x in (0, 3, 6)]
    assert all(s.frames == (0, 3) and s.carry_from is None for s in plan)
    lat = {"latents": ref["zt"] * vae.cfg.scaling_factor}
    parts = [(s, p.decode(lat, s, None, req)[0]["frames"].array) for s in plan]
    assert parts[4][1].dtype == np.float32 and parts[4][1].shape == (2, 9, 16, 16, 3)
    raw = hvae.assemble_tiles([[f for _, f in parts[i:i + 3]] for i in (0, 3, 6)], p.tiling(), 28, 28)
    assert_parity(raw.transpose(0, 4, 1, 2, 3), ref["dec_t"], what="staged tiles vs the reference's tiled decode")
    video = p.assemble_video(parts)
    np.testing.assert_array_equal(video, to_uint8(p.decode_video(lat["latents"], vae, True)))
    assert np.abs(video.astype(int) - to_uint8(to_unit_range(ref["dec_t"])).astype(int)).max() <= 1
    again = p.decode(lat, plan[4], None, req)[0]["frames"].array
    assert again.tobytes() == parts[4][1].tobytes()
    # without tiling: chunk-aligned frame ranges that concatenate to the chunked decode
    flat = SimpleNamespace(height=28, width=28, num_frames=25, options={"vae_tiling": False, "vae_chunk": 2},
                           decode_stages=None)
    spans = p.decode_plan(flat)
    assert [s.frames for s in spans] == [(0, 2), (2, 4), (4, 6), (6, 7)] and all(s.tile is None for s in spans)
