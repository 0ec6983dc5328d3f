"""LTX video VAEs: ``AutoencoderKLLTXVideo`` (0.9.0, 0.9.1 timestep-conditioned with injected noise,
0.9.5 blocks) and ``AutoencoderKLLTX2Video`` (reflect-padded decoder) against diffusers: encode
(posterior mean) and decode through ``load_pretrained``; the reference's tiled decode, whole and
as persisted tile stages."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat

V090 = dict(latent_channels=8, block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 16, 16),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=2)
V091 = dict(V090, timestep_conditioning=True, decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1, 1, 1, 1),
            decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(True, True, True, False),
            upsample_factor=(2, 2, 2), upsample_residual=(True, True, True))
V095 = dict(latent_channels=8, block_out_channels=(8, 16, 32, 32, 64), down_block_types=("LTXVideo095DownBlock3D",) * 4,
            decoder_block_out_channels=(16, 32, 64), layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
            decoder_inject_noise=(False,) * 4, downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=2)
V2 = dict(latent_channels=8, block_out_channels=(8, 16, 32, 32), decoder_block_out_channels=(8, 16, 32),
          layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), patch_size=2, decoder_causal=False)
CASES = {"0.9.0": ("AutoencoderKLLTXVideo", V090, False), "0.9.1": ("AutoencoderKLLTXVideo", V091, True),
         "0.9.5": ("AutoencoderKLLTXVideo", V095, True), "ltx2": ("AutoencoderKLLTX2Video", V2, False)}


def _ref(cls_name, kw, path):
    import diffusers

    torch.manual_seed(0)
    ref = perturb(getattr(diffusers, cls_name)(**kw), seed=1)
    with torch.no_grad():
        for n, b in ref.named_buffers():
            if "latents" in n:
                b.add_(0.1 * torch.randn(b.shape))
    ref.save_pretrained(path)
    return ref


def _recording_randn():
    """Replace torch.randn so the reference's injected decoder noise is recorded (draw order)."""
    drawn, orig = [], torch.randn

    def rec(*a, **k):
        k.pop("generator", None)
        out = orig(*a, **k)
        drawn.append(out.numpy().copy())
        return out

    return drawn, orig, rec


@pytest.mark.parametrize("case", sorted(CASES))
def test_encode_decode_parity(tmp_path, case):
    cls_name, kw, tcond = CASES[case]
    ref = _ref(cls_name, kw, tmp_path)
    m = compat.load_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    if case != "0.9.1":  # 0.9.1's encoder is 0.9.0's
        x = rng.uniform(-1, 1, (2, 3, 9, 32, 64)).astype(np.float32)
        with torch.no_grad():
            rz = to_numpy(ref.encode(torch.from_numpy(x)).latent_dist.mode())
        assert_parity(m.encode(x), rz, what=f"{cls_name} {case} encode")
    z = rng.standard_normal((2, 8, 2, 2, 2)).astype(np.float32)
    temb = np.array([0.05, 0.4], np.float32) if tcond else None
    drawn, orig, rec = _recording_randn()
    torch.randn = rec
    try:
        with torch.no_grad():
            rd = to_numpy(ref.decode(torch.from_numpy(z), None if temb is None else torch.from_numpy(temb)).sample)
    finally:
        torch.randn = orig
    out = m.decode(z, temb, key=drawn or None)  # injected noise: the reference's own draws, in order
    assert (len(drawn) > 0) == (case == "0.9.1")
    assert_parity(out, rd, what=f"{cls_name} {case} decode")


def test_tiled_decode_parity(tmp_path):
    """The reference's enable_tiling decode (tiles blended over their overlap)."""
    from vidax.models.ltx import vae as lvae

    ref = _ref("AutoencoderKLLTX2Video", V2, tmp_path)
    m = compat.load_pretrained(tmp_path)
    tiling = lvae.Tiling(min_height=96, min_width=96, stride_height=64, stride_width=64)
    ref.enable_tiling(tile_sample_min_height=96, tile_sample_min_width=96, tile_sample_stride_height=64,
                      tile_sample_stride_width=64)
    z = np.random.default_rng(1).standard_normal((1, 8, 2, 2, 4)).astype(np.float32)  # one row of 2 tiles
    with torch.no_grad():
        rd = to_numpy(ref.decode(torch.from_numpy(z)).sample)
    assert_parity(m.tiled_decode(z, tiling=tiling), rd, what="AutoencoderKLLTX2Video tiled decode")


def test_tiles_as_persisted_stages_equal_the_whole_blend():
    """One tile per stage in raster order, each carrying the blended edge strips its neighbours
    need: the regions concatenate to exactly the whole blend (3 x 4 tiles, uneven last ones)."""
    from vidax.models.ltx import vae as lvae

    tiling = lvae.Tiling(min_height=96, min_width=96, stride_height=64, stride_width=64)
    cfg = lvae.LTXVAEConfig()
    lh, lw = 7, 10
    grid = tiling.grid(cfg, lh, lw)
    rng = np.random.default_rng(0)
    raw = [[rng.standard_normal((1, 3, 5, (y1 - y0) * 32, (x1 - x0) * 32)).astype(np.float32)
            for (y0, y1, x0, x1) in row] for row in grid]
    whole = lvae.blend_tiles(raw, 32, 32, 64, 64, lh * 32, lw * 32)
    boxes = [(i, j) for i, row in enumerate(grid) for j in range(len(row))]
    carry, rows = None, {}
    for k, (i, j) in enumerate(boxes):
        region, carry = lvae.blend_tile(raw[i][j], i, j, carry, tiling, last=k == len(boxes) - 1)
        rows.setdefault(i, []).append(region)
    staged = np.concatenate([np.concatenate(r, axis=-1) for _, r in sorted(rows.items())], axis=-2)
    assert len(grid) == 4 and len(grid[0]) == 5
    np.testing.assert_array_equal(staged, whole)
