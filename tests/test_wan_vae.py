"""Parity of the Wan2.1 (and Wan2.2) VAE with diffusers' AutoencoderKLWan; original-release names; compile counts;
resumable decode cache; checkpoint mismatch errors."""

import jax
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.core.jit import CompileCounter
from vidax.weights import CheckpointMismatchError, open_checkpoint, save_safetensors

# the release's structure (dim_mult [1,2,4,4], 2 res blocks, [F,T,T] temporal), narrow
RELEASE = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
# a legal but unusual config: own decoder width, 3 levels, one temporal downsample (first level)
ODD = dict(base_dim=8, decoder_base_dim=12, z_dim=6, dim_mult=[1, 2, 2], num_res_blocks=1, attn_scales=[],
           temperal_downsample=[True, False], latents_mean=[0.0] * 6, latents_std=[1.0] * 6)


def _ref(cfg, seed=1):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    ref = perturb(AutoencoderKLWan(**cfg), seed=seed)
    with torch.no_grad():  # louder output so that the decoder's clamp to [-1, 1] matters
        ref.decoder.conv_out.weight.mul_(4.0)
    return ref


def _video(b, f, h, w, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (b, 3, f, h, w)).astype(np.float32)


def _latents(b, c, f, h, w, seed=0):
    return (2.0 * np.random.default_rng(seed).standard_normal((b, c, f, h, w))).astype(np.float32)


def _ref_encode(ref, x):
    with torch.no_grad():
        return to_numpy(ref.encode(torch.from_numpy(x)).latent_dist.mean)


def _ref_decode(ref, z):
    with torch.no_grad():
        return to_numpy(ref.decode(torch.from_numpy(z)).sample)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The narrow release-structured reference, saved as a diffusers folder."""
    ref = _ref(RELEASE)
    folder = tmp_path_factory.mktemp("wan_vae")
    ref.save_pretrained(folder)
    return ref, folder


def test_parity_release_structure(release):
    ref, folder = release
    m = compat.load_pretrained(folder)
    x = _video(1, 9, 32, 48)
    assert_parity(m.encode(x), _ref_encode(ref, x), what="AutoencoderKLWan encode mean (9 frames)")
    z = _latents(1, 4, 3, 4, 6)
    out, want = m.decode(z), _ref_decode(ref, z)
    assert out.shape == (1, 3, 9, 32, 48)
    assert (np.abs(want) == 1.0).mean() > 0.01, "test latents should make the reference clamp"
    assert_parity(out, want, what="AutoencoderKLWan decode (3 latent frames)")


def test_parity_unusual_config(tmp_path):
    ref = _ref(ODD, seed=2)
    ref.save_pretrained(tmp_path)
    m = compat.load_pretrained(tmp_path)
    x = _video(2, 13, 16, 24, seed=1)
    mean = m.encode(x)
    assert mean.shape == (2, 6, 7, 4, 6)  # 1 + 3 chunks x 2 latent frames
    assert_parity(mean, _ref_encode(ref, x), what="odd AutoencoderKLWan encode mean (13 frames, batch 2)")
    z = _latents(2, 6, 4, 4, 6, seed=3)
    out = m.decode(z)
    assert out.shape == (2, 3, 7, 16, 24)
    assert_parity(out, _ref_decode(ref, z), what="odd AutoencoderKLWan decode (4 latent frames, batch 2)")


def test_attn_scales(tmp_path):
    """attn_scales: diffusers' decoder ignores it (ported alike); its encoder puts attention blocks in
    down_blocks but then fails to call them (``WanAttentionBlock.forward`` takes no ``feat_cache``),
    so only the decode can be compared. Our encoder runs them as plain attention blocks."""
    cfg = {**ODD, "attn_scales": [1.0, 0.5]}
    ref = _ref(cfg, seed=3)
    ref.save_pretrained(tmp_path)
    m = compat.load_pretrained(tmp_path)
    z = _latents(1, 6, 3, 4, 4, seed=6)
    assert_parity(m.decode(z), _ref_decode(ref, z), what="attn_scales AutoencoderKLWan decode")
    x = _video(1, 5, 16, 16, seed=7)
    with pytest.raises(TypeError, match="feat_cache"):
        _ref_encode(ref, x)
    assert np.isfinite(m.encode(x)).all()


def test_original_release_names(release, tmp_path):
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from vidax.models.wan import vae

    ref, _ = release
    sd = {k: to_numpy(v) for k, v in ref.state_dict().items()}
    cfg = vae.WanVAEConfig.from_diffusers(dict(ref.config))
    ren = vae.diffusers_keymap(cfg).rename(sd, vae.original_keymap(cfg))
    orig = {ren[k]: v for k, v in sd.items()}
    assert "decoder.upsamples.4.shortcut.weight" in orig and "encoder.head.2.weight" in orig
    # independent check of the renaming: diffusers' own converter must give back the diffusers names
    back = convert_wan_vae_to_diffusers({k: torch.from_numpy(v) for k, v in orig.items()})
    assert sorted(back) == sorted(sd)
    for k in sd:
        np.testing.assert_array_equal(back[k].numpy(), sd[k])

    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save({k: torch.from_numpy(v) for k, v in orig.items()}, path)
    params, cfg2 = vae.load_vae(path)  # config inferred from the tensor shapes
    assert (cfg2.base_dim, cfg2.z_dim, cfg2.dim_mult, cfg2.num_res_blocks, cfg2.attn_scales,
            cfg2.temperal_downsample, cfg2.decoder_base_dim) == (16, 4, (1, 2, 4, 4), 2, (), (False, True, True), None)
    x = _video(1, 5, 16, 16, seed=4)
    assert_parity(vae.encode(params, cfg2, x), _ref_encode(ref, x), what="encode from the original .pth")
    z = _latents(1, 4, 3, 2, 2, seed=5)
    assert_parity(vae.decode(params, cfg2, z), _ref_decode(ref, z), what="decode from the original .pth")


def test_decode_compiles_at_most_twice():
    from vidax.models.wan import vae

    cfg = vae.WanVAEConfig(**{**RELEASE, "base_dim": 8})
    params = vae.init_params(cfg, seed=3)
    z = np.random.default_rng(0).standard_normal((1, cfg.z_dim, 5, 3, 5)).astype(np.float32)  # a fresh shape
    with CompileCounter() as cc:
        out = vae.decode(params, cfg, z)
    print(f"5-chunk decode: {cc.count} compiles, {cc.seconds:.1f}s")
    assert out.shape == (1, 3, 17, 24, 40)
    assert 1 <= cc.count <= 2, f"a 5-chunk decode compiled {cc.count} programs"
    with CompileCounter() as cc:
        vae.decode(params, cfg, z[:, :, :3])  # another length: no new program
    assert cc.count == 0


def test_two_loaded_states_of_one_config_are_their_own():
    """Loading a second VAE of the same config leaves the first one's weights as they were (the
    abstract state each load fills is its own), and the 3-tap kernels are held split by time tap."""
    from vidax.core import conv as vconv
    from vidax.models.wan import vae

    cfg = vae.WanVAEConfig(**{**RELEASE, "base_dim": 8})
    fill = lambda v: jax.tree.map(lambda s: np.full(s.shape, v, s.dtype), vae.param_shapes(cfg))  # noqa: E731
    a = vae.state_from_pure(cfg, fill(1.0))
    b = vae.state_from_pure(cfg, fill(2.0))
    assert a is not b
    assert {float(np.max(x)) for x in jax.tree.leaves(a)} == {1.0}
    assert {float(np.max(x)) for x in jax.tree.leaves(b)} == {2.0}
    kernel = vconv.kernel_value(a["decoder"]["conv_in"]["kernel"])
    assert isinstance(kernel, tuple) and len(kernel) == 3 and kernel[0].ndim == 4


def test_decode_resumes_from_a_persisted_cache():
    from vidax.models.wan import vae

    cfg = vae.WanVAEConfig(**{**RELEASE, "base_dim": 8})
    params = vae.init_params(cfg, seed=4)
    z = np.random.default_rng(1).standard_normal((1, cfg.z_dim, 5, 3, 5)).astype(np.float32)
    full = vae.decode(params, cfg, z)
    k = 2
    head, cache = vae.decode(params, cfg, z, stop=k, return_cache=True)
    saved = vae.cache_to_numpy(cache)  # e.g. written by a pipeline stage, read back by the next one
    assert all(isinstance(v, np.ndarray) for v in saved.values())
    spec = vae.decode_cache_spec(params, cfg, 1, 3, 5)
    assert {n: (s.shape, s.dtype) for n, s in spec.items()} == {n: (v.shape, v.dtype) for n, v in saved.items()}
    tail = vae.decode(params, cfg, z, start=k, cache={n: np.array(v) for n, v in saved.items()})
    np.testing.assert_array_equal(np.concatenate([head, tail], axis=2), full)
    # chunk by chunk through the public chunk function, round-tripping the cache every time
    outs, cache = [], None
    for i in range(z.shape[2]):
        px, cache = vae.decode_chunk(params, cfg, z[:, :, i:i + 1], cache, first=i == 0)
        cache = vae.cache_to_numpy(cache)
        outs.append(np.asarray(px))
    np.testing.assert_array_equal(np.concatenate(outs, axis=2), full)


def test_encode_chunks_and_cache():
    from vidax.models.wan import vae

    cfg = vae.WanVAEConfig(**{**RELEASE, "base_dim": 8})
    params = vae.init_params(cfg, seed=5)
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3, 10, 16, 16)).astype(np.float32)
    with CompileCounter() as cc:
        mean = vae.encode(params, cfg, x)  # 10 frames: the last one is dropped, as in the reference
    assert mean.shape == (1, cfg.z_dim, 3, 2, 2)
    assert cc.count <= 2
    outs, cache = [], None
    for i in range(vae.num_encode_chunks(x.shape[2])):
        m, cache = vae.encode_chunk(params, cfg, x[:, :, vae.encode_chunk_frames(i)], cache, first=i == 0)
        cache = vae.cache_to_numpy(cache)
        outs.append(np.asarray(m)[:, : cfg.z_dim])
    np.testing.assert_array_equal(np.concatenate(outs, axis=2), mean)


def test_conv_impls_agree():
    """The 3-D conv formulation (the default off CPU) equals the folded 2-D convs and the CPU default's
    per-tap 2-D convs, through cached chunks and the stride-2 time conv of a temporal downsample."""
    from vidax.models.wan import vae

    cfg = vae.WanVAEConfig(**{**RELEASE, "base_dim": 8})
    state = vae.init_params(cfg, seed=6)
    for fn, a in ((vae.decode, _latents(1, cfg.z_dim, 2, 2, 3, seed=10)), (vae.encode, _video(1, 5, 16, 24, seed=11))):
        native = fn(state, cfg, a, conv_impl="native")
        for impl in ("fold", "taps"):
            assert_parity(native, fn(state, cfg, a, conv_impl=impl), what=f"{fn.__name__}: native vs {impl}")


def _tamper(folder, dst, fn):
    ckpt = open_checkpoint(folder).numpy()
    ckpt = fn(dict(ckpt))
    dst.mkdir()
    save_safetensors(ckpt, dst / "diffusion_pytorch_model.safetensors")
    (dst / "config.json").write_text((folder / "config.json").read_text())
    return dst


@pytest.mark.parametrize(
    "case, key",
    [
        ("missing", "decoder.up_blocks.1.resnets.0.conv_shortcut.weight"),
        ("extra", "decoder.up_blocks.9.resnets.0.norm1.gamma"),
        ("misshaped", "encoder.mid_block.attentions.0.to_qkv.weight"),
        ("misshaped", "decoder.norm_out.gamma"),
    ],
)
def test_mismatched_checkpoint(release, tmp_path, case, key):
    from vidax.models.wan import vae

    _, folder = release

    def fn(sd):
        if case == "missing":
            del sd[key]
        elif case == "extra":
            sd[key] = np.ones((4, 1, 1, 1), np.float32)
        else:
            sd[key] = np.concatenate([sd[key], sd[key][:1]], axis=0)
        return sd

    bad = _tamper(folder, tmp_path / "bad", fn)
    with pytest.raises(CheckpointMismatchError, match=key.replace(".", r"\.")):
        vae.load_vae(bad)
    word = {"missing": "missing", "extra": "unexpected", "misshaped": "mis-shaped"}[case]
    with pytest.raises(CheckpointMismatchError, match=word):
        compat.load_pretrained(bad)


def test_parity_wan22_residual(tmp_path):
    """Wan2.2's VAE: residual down/up blocks with pooling/duplicating shortcuts, 2x2 patchify."""
    cfg = dict(base_dim=8, decoder_base_dim=16, z_dim=8, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
               temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12,
               out_channels=12, scale_factor_spatial=16, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    ref = _ref(cfg, seed=4)
    ref.save_pretrained(tmp_path)
    m = compat.load_pretrained(tmp_path)
    x = _video(1, 9, 32, 48, seed=8)
    assert_parity(m.encode(x), _ref_encode(ref, x), what="Wan2.2 AutoencoderKLWan encode mean (9 frames)")
    z = _latents(1, 8, 3, 2, 3, seed=9)
    out = m.decode(z)
    assert out.shape == (1, 3, 9, 32, 48)
    assert_parity(out, _ref_decode(ref, z), what="Wan2.2 AutoencoderKLWan decode (3 latent frames)")
    from vidax.models.wan import vae

    with pytest.raises(NotImplementedError, match="is_residual"):
        vae.original_keymap(m.model_config)


def test_config_fields():
    from vidax.models.wan import vae

    cfg = vae.WanVAEConfig.from_diffusers({"_class_name": "AutoencoderKLWan", **RELEASE, "dim_mult": [1, 2, 4, 4]})
    assert cfg.dim_mult == (1, 2, 4, 4) and cfg.temporal_ratio == 4 and cfg.spatial_ratio == 8
    hash(cfg)
    assert vae.PRESETS["wan2.2"].spatial_ratio == 16
    with pytest.raises(ValueError, match="patch_size"):
        vae.WanVAEConfig.from_diffusers({**RELEASE, "patch_size": 0})
    with pytest.raises(ValueError, match="temperal_downsample"):
        vae.WanVAEConfig.from_diffusers({**RELEASE, "temperal_downsample": [True]})
    z = np.random.default_rng(0).standard_normal((1, 16, 2, 1, 3)).astype(np.float32)
    w = vae.WanVAEConfig()
    n = vae.normalize_latents(w, z)
    np.testing.assert_allclose(n[:, 5], (z[:, 5] - w.latents_mean[5]) / w.latents_std[5], rtol=1e-6)
    np.testing.assert_allclose(vae.denormalize_latents(w, n), z, rtol=1e-5, atol=1e-5)
    zc = np.ascontiguousarray(z.transpose(0, 2, 3, 4, 1))
    np.testing.assert_allclose(vae.normalize_latents(w, zc, axis=-1), n.transpose(0, 2, 3, 4, 1), rtol=1e-6)


@pytest.mark.parametrize("which", ["wan2.1", "wan2.2"])
def test_full_size_key_maps(which):
    """The key maps cover the full-size Wan2.1 / Wan2.2 VAEs exactly (shapes only: meta tensors)."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from vidax.models.wan import vae
    from vidax.weights import LazyTensor, load_params

    cfg = vae.PRESETS[which]
    kw = {} if which == "wan2.1" else dict(
        base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2, in_channels=12,
        out_channels=12, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    with torch.device("meta"):
        ref = AutoencoderKLWan(**kw)
    assert vae.WanVAEConfig.from_diffusers(dict(ref.config)) == cfg
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}

    def lazy(names):
        return {n: LazyTensor(n, shapes[n], np.dtype(np.float32),
                              lambda s=shapes[n]: np.broadcast_to(np.float32(0), s)) for n in names}

    params = load_params(lazy(shapes), vae.diffusers_keymap(cfg), vae.param_shapes(cfg), dtype=np.float16)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    assert sum(a.size for a in jax.tree.leaves(params)) == n_params
    if which == "wan2.1":
        ren = vae.diffusers_keymap(cfg).rename(shapes, vae.original_keymap(cfg))
        back = convert_wan_vae_to_diffusers({ren[k]: k for k in shapes})
        assert back == {k: k for k in shapes}


@pytest.mark.parametrize("which", ["wan2.1", "wan2.2"])
def test_tiled_decode_matches_the_reference_tiled_decode(which, tmp_path, monkeypatch):
    """``tiled_decode`` = ``AutoencoderKLWan.tiled_decode`` (``enable_tiling`` with the same tile and
    stride): tiles decoded with their own caches, cross-faded, clamped; resumable across frame
    ranges; and not the same as the whole-frame decode (the tiles really are separate). The tiles
    run one per device (the 8 fake CPU devices), as they do one after the other on one device; and
    as persisted stages (tile groups x frame ranges, each from its group's carried caches, blended
    when assembled) they give the same video bitwise."""
    from vidax.models.wan import tiles as wtiles
    from vidax.models.wan import vae as wvae

    cfg = RELEASE if which == "wan2.1" else dict(
        base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
        temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
        scale_factor_spatial=16, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    ref = _ref(cfg)
    ref.save_pretrained(tmp_path)
    r = 8 if which == "wan2.1" else 16
    tile, stride = 4 * r, 3 * r  # 4-latent tiles every 3 latents: overlaps in both directions
    ref.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_sample_stride_height=stride,
                      tile_sample_stride_width=stride)
    z = _latents(1, 4, 3, 7, 9, seed=3)  # 7 x 9 latents: 3 x 3 tiles, the last ones partial
    want = _ref_decode(ref, z)
    cm = compat.load_pretrained(tmp_path)
    got = wtiles.tiled_decode(cm.params, cm.model_config, z, tile=tile, stride=stride)
    assert got.shape == want.shape
    assert_parity(got, want, what=f"{which} tiled decode")
    assert np.abs(got - wvae.decode(cm.params, cm.model_config, z)).max() > 1e-3
    a, cache = wtiles.tiled_decode(cm.params, cm.model_config, z, stop=2, tile=tile, stride=stride, return_cache=True)
    cache = {k: np.asarray(v) for k, v in cache.items()}  # as a decode stage persists it
    b = wtiles.tiled_decode(cm.params, cm.model_config, z, start=2, cache=cache, tile=tile, stride=stride)
    np.testing.assert_array_equal(np.concatenate([a, b], axis=2), got)

    # one tile per device = one tile after the other on one device (the four full 4x4-latent tiles)
    assert len(jax.local_devices()) == 8
    full = [0, 1, 3, 4]
    kw = dict(tile=tile, stride=stride, return_cache=False)
    par, _ = wtiles.decode_tiles(cm.params, cm.model_config, z, full, **kw)
    seq, _ = wtiles.decode_tiles(cm.params, cm.model_config, z, full, devices=1, **kw)
    for n in full:  # (the convs' own rounding differs with the threads a device gets; Winograd over
        # time combines the products with constants up to ~8: vidax.core.conv.winograd_time_conv)
        np.testing.assert_allclose(par[n], seq[n], rtol=0, atol=2e-5)

    # persisted stages: 2 tile groups (tile rows {0, 3} and {6}) x 3 frame ranges
    monkeypatch.setattr(wtiles, "TILE", tile)
    monkeypatch.setattr(wtiles, "TILE_STRIDE", stride)
    plan = wtiles.tile_plan(cm.model_config, 3, 7, 9)
    assert [(s.frames, s.tile, s.carry_from) for s in plan] == [
        ((0, 1), (0, 7, 0, 9), None), ((0, 1), (6, 7, 0, 9), None),
        ((1, 2), (0, 7, 0, 9), "decode/0"), ((1, 2), (6, 7, 0, 9), "decode/1"),
        ((2, 3), (0, 7, 0, 9), "decode/2"), ((2, 3), (6, 7, 0, 9), "decode/3")]
    parts, carries = [], {}
    for s in plan:  # latents_mean 0, latents_std 1: the stored latents are z
        tiles, carries[s.name] = wtiles.decode_tile_stage((cm.params, cm.model_config), z, s,
                                                        carries.get(s.carry_from), plan)
        parts.append((s, tiles))
    assert {k.split("/")[0] for k in carries["decode/1"]} == {"6", "7", "8"}  # a group carries its own tiles
    assert carries["decode/4"] is None  # nothing carries on from the last frame range
    np.testing.assert_array_equal(wtiles.assemble_tile_stages(cm.model_config, parts[::-1]), got)
