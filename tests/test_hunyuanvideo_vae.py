"""HunyuanVideo VAE: decode / encode parity with diffusers' AutoencoderKLHunyuanVideo (temporal tiles,
spatial tiles), persisted tile ranges concatenating bitwise to the whole decode, the original
release's ``.pt``."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.models.hunyuanvideo import vae as hvae

# three levels (4x spatial, 4x temporal: a configuration the reference supports) keep the compiles short
VAE = dict(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1, norm_num_groups=4,
           spatial_compression_ratio=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
           up_block_types=("HunyuanVideoUpBlock3D",) * 3)
TILES = dict(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=12,
             tile_sample_stride_width=12)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    m = perturb(AutoencoderKLHunyuanVideo(**VAE), seed=2)
    folder = tmp_path_factory.mktemp("hv_vae")
    m.save_pretrained(folder)
    return m, folder


@pytest.fixture(scope="module")
def ours(ref):
    return compat.load_pretrained(ref[1])


def test_decode_temporal_tiles_parity(ref, ours):
    """6 latent frames: the reference decodes overlapping 5-frame tiles every 3 and cross-fades 4
    frames; B=2, non-square."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 4, 6, 3, 5)).astype(np.float32)
    with torch.no_grad():
        r = to_numpy(ref[0].decode(torch.from_numpy(z)).sample)
    assert r.shape == (2, 3, 21, 12, 20)
    assert_parity(ours.decode(z), r, what="AutoencoderKLHunyuanVideo decode (temporal tiles)")
    # the same decode as persisted stages: tile ranges [0, 1) and [1, 2) with the tail carried
    vae = ours.vae
    tiles = hvae.temporal_tiles(6)
    assert tiles == [(0, 5), (3, 6)]
    a, tail = hvae.decode_tiles(vae, z, 0, 1, None)
    b, _ = hvae.decode_tiles(vae, z, 1, 2, tail)
    np.testing.assert_array_equal(np.concatenate([a, b], axis=2), hvae.decode(vae, z))


def test_encode_parity(ref, ours):
    """21 frames (> 16: overlapping 17-frame tiles every 12, one latent frame cross-faded); the
    posterior mean."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (1, 3, 21, 12, 20)).astype(np.float32)
    with torch.no_grad():
        r = to_numpy(ref[0].encode(torch.from_numpy(x)).latent_dist.mode())
    assert_parity(ours.encode(x), r, what="AutoencoderKLHunyuanVideo encode (temporal tiles)")


def test_spatial_tiles_parity(ref, ours, tmp_path):
    """``enable_tiling`` (here 16-px tiles every 12): overlapping spatial tiles cross-faded inside
    every temporal tile (two rows of tiles, in place as the reference blends), for decode and
    encode; loaded from the original release's ``.pt``."""
    from diffusers import AutoencoderKLHunyuanVideo

    m = AutoencoderKLHunyuanVideo(**VAE)
    m.load_state_dict(ref[0].state_dict())
    m.enable_tiling(**TILES)
    path = tmp_path / "pytorch_model.pt"
    torch.save({"state_dict": {f"vae.{k}": v for k, v in ref[0].state_dict().items()}}, path)
    cfg = hvae.HunyuanVAEConfig.from_diffusers(dict(ref[0].config))
    ours_t = hvae._Compat({}, hvae.load_vae(path, cfg), hvae.Tiling())
    ours_t.enable_tiling(**TILES)
    rng = np.random.default_rng(2)
    z = rng.standard_normal((1, 4, 2, 5, 3)).astype(np.float32)
    with torch.no_grad():
        r = to_numpy(m.decode(torch.from_numpy(z)).sample)
    assert_parity(ours_t.decode(z), r, what="AutoencoderKLHunyuanVideo tiled decode")
    x = rng.uniform(-1, 1, (1, 3, 1, 20, 12)).astype(np.float32)
    with torch.no_grad():
        r = to_numpy(m.encode(torch.from_numpy(x)).latent_dist.mode())
    assert_parity(ours_t.encode(x), r, what="AutoencoderKLHunyuanVideo tiled encode")
