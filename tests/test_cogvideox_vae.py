"""Parity of the CogVideoX VAE with diffusers' AutoencoderKLCogVideoX: decode through the
reference's frame batches (odd and even latent counts), encode (posterior mean and log-variance),
tiled decode, decode resumed per batch from a persisted cache (bitwise), original release names,
compile counts."""
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat

# three levels (4x spatial, 4x temporal: both up/downsamplers compress time), small programs
TINY = dict(block_out_channels=(8, 16, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4,
            sample_height=32, sample_width=48, down_block_types=("CogVideoXDownBlock3D",) * 3,
            up_block_types=("CogVideoXUpBlock3D",) * 3)
Z = (4, 6)  # latent height, width of every untiled decode here (one program per batch kind)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(0)
    ref = perturb(AutoencoderKLCogVideoX(**TINY), seed=2)
    path = tmp_path_factory.mktemp("cog-vae")
    ref.save_pretrained(path)
    return ref, path, compat.load_pretrained(path)


@pytest.mark.parametrize("frames", [1, 4, 5])  # one batch; even (2+2); odd with a 3-frame first batch
def test_decode_parity(saved, frames):
    ref, _, ours = saved
    z = np.random.default_rng(frames).standard_normal((2, 4, frames, *Z)).astype(np.float32)
    with torch.no_grad():
        want = to_numpy(ref.decode(torch.from_numpy(z)).sample)
    got = ours.decode(z)
    assert got.shape == want.shape
    assert_parity(got, want, what=f"AutoencoderKLCogVideoX decode, {frames} latent frames")


@pytest.mark.parametrize("frames", [1, 9, 17])  # a still image (I2V); one batch; 8+1 then 8
def test_encode_parity(saved, frames):
    from vidax.models.cogvideox import vae as cv

    ref, _, ours = saved
    x = np.random.default_rng(10 + frames).uniform(-1, 1, (2, 3, frames, 16, 24)).astype(np.float32)
    with torch.no_grad():
        dist = ref.encode(torch.from_numpy(x)).latent_dist
    mean, logvar = cv.encode(ours.vae, x, return_logvar=True)
    assert mean.shape[2] == cv.latent_frames(ours.vae.cfg, frames)
    assert_parity(mean, to_numpy(dist.mean), what=f"encode mean, {frames} frames")
    assert_parity(ours.encode(x), to_numpy(dist.mean), what="compat encode")
    assert_parity(logvar, to_numpy(dist.logvar), what="encode logvar")
    noise = np.random.default_rng(0).standard_normal(mean.shape).astype(np.float32)
    assert_parity(cv.sample_posterior(mean, logvar, noise), to_numpy(dist.mean + dist.std * torch.from_numpy(noise)),
                  what="posterior sample")


def test_tiled_decode_parity_and_resume(saved):
    """The reference's tiled decode (2 x 2 overlapping tiles, blended in place); then a tiled decode
    in two spans with the per-tile caches through host numpy: bitwise the one-call tiled decode."""
    from vidax.models.cogvideox import vae as cv

    ref, _, ours = saved
    # latent tiles of 5 x 6, overlapping: 2 x 2 tiles (one of them the untiled tests' 4 x 6)
    z = np.random.default_rng(7).standard_normal((1, 4, 1, 8, 8)).astype(np.float32)
    ref.enable_tiling(tile_sample_min_height=20, tile_sample_min_width=24)
    try:
        with torch.no_grad():
            want = to_numpy(ref.decode(torch.from_numpy(z)).sample)
    finally:
        ref.disable_tiling()
    ours.enable_tiling(tile_sample_min_height=20, tile_sample_min_width=24)
    try:
        got = ours.decode(z)
    finally:
        ours.tiling = None
    assert_parity(got, want, what="tiled decode (2x2 tiles)")
    tiling = cv.Tiling(20, 24, spatial_ratio=4)
    z = np.random.default_rng(8).standard_normal((1, 4, 5, *Z[:1], 8)).astype(np.float32)  # one row, two columns
    whole = cv.tiled_decode(ours.vae, z, tiling)
    parts, cache = [], None
    for a, b in [(0, 3), (3, 5)]:
        px, cache = cv.tiled_decode(ours.vae, z, tiling, start=a, stop=b, cache=cache, return_cache=True)
        cache = cv.cache_to_numpy(cache)
        parts.append(px)
    assert sorted({k.split("/")[0] for k in cache}) == ["0.0", "0.1"]
    assert np.concatenate(parts, axis=2).tobytes() == whole.tobytes()


def test_decode_resumes_per_batch_bitwise(saved):
    """Decode batch by batch, the cache through host numpy between (as decode stages persist it):
    the concatenation is bitwise the one-call decode; a span must be whole batches."""
    from vidax.models.cogvideox import vae as cv

    _, _, ours = saved
    z = np.random.default_rng(3).standard_normal((1, 4, 7, *Z)).astype(np.float32)
    assert cv.decode_batches(7) == [(0, 3), (3, 5), (5, 7)]
    whole = cv.decode(ours.vae, z)
    parts, cache = [], None
    for a, b in [(0, 3), (3, 7)]:
        px, cache = cv.decode(ours.vae, z, start=a, stop=b, cache=cache, return_cache=True)
        cache = cv.cache_to_numpy(cache)
        parts.append(px)
    assert np.concatenate(parts, axis=2).tobytes() == whole.tobytes()
    with pytest.raises(ValueError, match="whole decoder batches"):
        cv.decode(ours.vae, z, start=0, stop=4)


def test_decode_compiles_twice_per_size(saved):
    """One program for the first batch and one for every later batch, whatever the length."""
    from vidax.core.jit import CompileCounter
    from vidax.models.cogvideox import vae as cv

    _, _, ours = saved
    rng = np.random.default_rng(4)
    cv.decode(ours.vae, rng.standard_normal((1, 4, 5, *Z)).astype(np.float32))  # warm: first + later
    with CompileCounter() as cc:
        for n in (5, 9, 13):
            cv.decode(ours.vae, rng.standard_normal((1, 4, n, *Z)).astype(np.float32))
    assert cc.count == 0, cc.count


def test_original_release_names(tmp_path, saved):
    """The original (SAT) release file (``3d-vae.pt``, a torch zip pickle under "state_dict"), its
    names made by inverting diffusers' conversion script's renames."""
    from vidax.models.cogvideox import vae as cv
    ref, _, ours = saved
    sd = {k: to_numpy(v) for k, v in ref.state_dict().items()}
    inv = {}
    for k, v in sd.items():
        n = k.replace("mid_block.resnets.0", "mid.block_1").replace("mid_block.resnets.1", "mid.block_2")
        n = n.replace("resnets.", "block.").replace("down_blocks.", "down.").replace("downsamplers.0", "downsample")
        n = n.replace("upsamplers.0", "upsample").replace("conv_shortcut", "nin_shortcut")
        if n.startswith("decoder.up_blocks."):
            p = n.split(".")
            n = ".".join(["decoder", "up", str(2 - int(p[2]))] + p[3:])
        assert cv.original_to_diffusers(n, num_levels=3) == k, (n, k)
        inv[n] = v
    inv["loss.logvar"] = np.zeros(1, np.float32)  # training leftovers are skipped
    torch.save({"state_dict": {k: torch.from_numpy(v) for k, v in inv.items()}}, tmp_path / "3d-vae.pt")
    vae = cv.load_vae(tmp_path / "3d-vae.pt", ours.vae.cfg)
    z = np.random.default_rng(5).standard_normal((1, 4, 3, *Z)).astype(np.float32)
    np.testing.assert_array_equal(cv.decode(vae, z), ours.decode(z))


def test_mismatched_checkpoint_is_reported(saved, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from vidax.weights import CheckpointMismatchError

    _, path, _ = saved
    shutil.copytree(path, tmp_path / "vae")
    f = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "decoder.up_blocks.1.resnets.0.norm1.conv_y.conv.weight"
    sd[key] = sd[key][:, :-1].copy()
    del sd["encoder.conv_out.conv.bias"]
    save_file(sd, f)
    with pytest.raises(CheckpointMismatchError) as e:
        compat.load_pretrained(tmp_path / "vae")
    msg = str(e.value)
    assert "1 missing: encoder.conv_out.conv.bias" in msg and f"1 mis-shaped: {key} (shape [16, 3, 1, 1, 1]" in msg
    assert str(tmp_path / "vae") in msg
