"""LTX-2 components against diffusers: the audio+video DiT (``LTX2VideoTransformer3DModel``: T2V
and I2V calls, both outputs, the 2.x switches), the text connectors (``LTX2TextConnectors``,
values *and* conditioning scale), the audio VAE (``AutoencoderKLLTX2Audio``) and vocoders
(``LTX2Vocoder``, ``LTX2VocoderWithBWE``), the diffusion decoder (``LTX2VideoDiffusionDecoderModel``,
``denoise``); all through ``load_pretrained`` from ``save_pretrained`` folders."""
import warnings

import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat

DIT = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
           audio_in_channels=6, audio_out_channels=6, audio_num_attention_heads=2, audio_attention_head_dim=6,
           audio_cross_attention_dim=12, num_layers=2, caption_channels=10)
F, H, W, LA = 2, 3, 4, 5
S = F * H * W


def _save(model, path):
    model.save_pretrained(path)
    return compat.load_pretrained(path)


def _dit_inputs(ref, b=2, seed=0, **over):
    rng = np.random.default_rng(seed)
    cc = ref.config.caption_channels if ref.config.use_prompt_embeddings else None
    mask = np.ones((b, 7), np.float32)
    mask[-1, 5:] = 0
    kw = dict(hidden_states=rng.standard_normal((b, S, 8)).astype(np.float32),
              audio_hidden_states=rng.standard_normal((b, LA, 6)).astype(np.float32),
              encoder_hidden_states=rng.standard_normal((b, 7, cc or 16)).astype(np.float32),
              audio_encoder_hidden_states=rng.standard_normal((b, 7, cc or 12)).astype(np.float32),
              timestep=np.array([900.0, 300.0][:b], np.float32), encoder_attention_mask=mask,
              audio_encoder_attention_mask=mask, num_frames=F, height=H, width=W, fps=24.0, audio_num_frames=LA)
    kw.update(over)
    return kw


def _ref_call(ref, kw):
    tkw = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    with torch.no_grad():
        v, a = ref(**tkw, return_dict=False)
    return to_numpy(v), to_numpy(a)


# name -> (config switches, extra forward arguments)
VARIANTS = {
    "ltx2.0-t2v": ({}, {}),
    "split-rope-i2v": ({"rope_type": "split", "cross_attn_mod": True, "use_prompt_adaln_single": False},
                       dict(timestep=np.concatenate([np.zeros((2, 12)), np.full((2, 12), 700.0)], 1).astype(np.float32),
                            audio_timestep=np.array([700.0, 700.0], np.float32), sigma=np.array([700.0, 700.0], np.float32),
                            isolate_modalities=True)),
    "ltx2.3-switches-stg": ({"gated_attn": True, "audio_gated_attn": True, "cross_attn_mod": True,
                             "audio_cross_attn_mod": True, "use_prompt_embeddings": False, "ff_bias": False,
                             "perturbed_attn": True, "use_keyframes_abs_pos_embedding": True},
                            dict(sigma=np.array([900.0, 300.0], np.float32), use_cross_timestep=True,
                                 spatio_temporal_guidance_blocks=[1], perturbation_mask=np.array([0.0, 1.0], np.float32))),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dit_parity(tmp_path, variant):
    from diffusers import LTX2VideoTransformer3DModel

    switches, extra = VARIANTS[variant]
    torch.manual_seed(0)
    ref = perturb(LTX2VideoTransformer3DModel(**{**DIT, **switches}), seed=1)
    if switches.get("use_keyframes_abs_pos_embedding"):
        km = np.zeros((2, S, 1), np.float32)
        km[:, :12] = 1
        extra = dict(extra, video_keyframes_mask=km)
    m = _save(ref, tmp_path)
    kw = _dit_inputs(ref, **extra)
    if variant == "ltx2.0-t2v":  # coordinates precomputed, as the pipelines pass them
        kw["video_coords"] = ref.rope.prepare_video_coords(2, F, H, W, "cpu", fps=24.0).numpy()
        kw["audio_coords"] = ref.audio_rope.prepare_audio_coords(2, LA, "cpu").numpy()
    v, a = m.forward(**kw)
    rv, ra = _ref_call(ref, kw)
    assert_parity(v, rv, what=f"LTX2 DiT {variant} video")
    assert_parity(a, ra, what=f"LTX2 DiT {variant} audio")


def test_dit_original_release_names(tmp_path):
    """The original LTX-2 release names (``model.diffusion_model.*``), checked against diffusers'
    own converter, load into the same model."""
    import jax
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    from vidax.models.ltx import dit2
    from vidax.weights import save_safetensors

    torch.manual_seed(0)
    ref = perturb(LTX2VideoTransformer3DModel(**{**DIT, "cross_attn_mod": True}), seed=1)
    sd = {k: to_numpy(v) for k, v in ref.state_dict().items()}
    cfg = dit2.LTX2DiTConfig.from_diffusers(dict(ref.config))
    ren = dit2.diffusers_keymap(cfg).rename(sd, dit2.original_keymap(cfg))
    orig = {"model.diffusion_model." + ren[k]: v for k, v in sd.items()}
    back = convert_ltx2_transformer_to_diffusers({k: torch.from_numpy(v) for k, v in orig.items()})
    assert sorted(back) == sorted(sd)
    save_safetensors(orig, tmp_path / "ltx-2-dev.safetensors")
    state, cfg2 = dit2.load_dit(tmp_path / "ltx-2-dev.safetensors", cfg)
    kw = _dit_inputs(ref, sigma=np.array([900.0, 300.0], np.float32))
    vc = ref.rope.prepare_video_coords(2, F, H, W, "cpu", fps=24.0).numpy()
    ac = ref.audio_rope.prepare_audio_coords(2, LA, "cpu").numpy()
    inp = dit2.model_inputs(cfg2, kw["hidden_states"], kw["audio_hidden_states"], kw["encoder_hidden_states"],
                            kw["audio_encoder_hidden_states"], kw["timestep"], dit2.rope_tables(cfg2, vc, ac),
                            sigma=kw["sigma"], mask=kw["encoder_attention_mask"], amask=kw["audio_encoder_attention_mask"])
    out = jax.jit(dit2.forward, static_argnums=1)(jax.device_put(state), cfg2, inp)
    rv, ra = _ref_call(ref, kw)
    assert_parity(np.asarray(out["y"]), rv, what="LTX2 DiT from original names (video)")
    assert_parity(np.asarray(out["ya"]), ra, what="LTX2 DiT from original names (audio)")


CONN = dict(caption_channels=12, text_proj_in_factor=3, video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=6, video_connector_num_layers=2, video_connector_num_learnable_registers=4,
            audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=6, audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=4, video_hidden_dim=12, audio_hidden_dim=12)


@pytest.mark.parametrize("variant", ["ltx2.0-left", "ltx2.0-right-split", "ltx2.3-per-modality"])
def test_connectors_parity_and_scale(tmp_path, variant):
    """Values, and the conditioning *scale*: the feature extractor's output level and how much the
    final embeddings move between two prompts (a 7x too weak feature rescale would let the learned
    registers swamp the prompt while every shape stays right)."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors, per_layer_masked_mean_norm

    cfg = dict(CONN)
    side = "right" if "right" in variant else "left"
    if "split" in variant:
        cfg.update(rope_type="split", video_gated_attn=True)
    if "per-modality" in variant:
        cfg.update(per_modality_projections=True, proj_bias=True, video_connector_attention_head_dim=8,
                   video_hidden_dim=16, audio_hidden_dim=12)
    torch.manual_seed(0)
    ref = perturb(LTX2TextConnectors(**cfg), seed=1)
    m = _save(ref, tmp_path)
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((2, 8, 12, 3)) * np.array([1.0, 30.0, 200.0])).astype(np.float32)  # growing layer norms
    mask = np.ones((2, 8), np.int64)
    mask[1, :3] = 0 if side == "left" else 1
    if side == "right":
        mask[1, 5:] = 0
    with torch.no_grad():
        rv, ra, rm = (to_numpy(t) for t in ref(torch.from_numpy(h), torch.from_numpy(mask), padding_side=side))
    v, a, mm = m.forward(h, mask, padding_side=side)
    assert_parity(v, rv, what=f"connectors {variant} video")
    assert_parity(a, ra, what=f"connectors {variant} audio")
    np.testing.assert_array_equal(mm, rm)
    # scale 1: the extracted features (what the connector transformer reads) at the reference's level
    import jax.numpy as jnp

    fv, fa = m.split.apply("features", jnp.asarray(h), jnp.asarray(mask), padding_side=side)
    with torch.no_grad():
        th = torch.from_numpy(h)
        if cfg.get("per_modality_projections"):
            n = th * torch.rsqrt(th.pow(2).mean(2, keepdim=True) + 1e-6)
            n = torch.where(torch.from_numpy(mask).bool()[..., None], n.flatten(2), 0)
            rfv = to_numpy(ref.video_text_proj_in(n * (16 / 12) ** 0.5))
        else:
            n = per_layer_masked_mean_norm(th, torch.from_numpy(mask).sum(-1), "cpu", side, 8)
            rfv = to_numpy(ref.text_proj_in(n))
    ours_rms, ref_rms = float(np.sqrt(np.mean(np.square(fv)))), float(np.sqrt(np.mean(np.square(rfv))))
    print(f"feature rms: vidax {ours_rms:.4f}, reference {ref_rms:.4f}")
    assert abs(ours_rms / ref_rms - 1) < 1e-4
    # scale 2: prompt sensitivity of the final embeddings
    h2 = h + (0.5 * rng.standard_normal(h.shape) * np.array([1.0, 30.0, 200.0])).astype(np.float32)
    v2, _, _ = m.forward(h2, mask, padding_side=side)
    with torch.no_grad():
        rv2 = to_numpy(ref(torch.from_numpy(h2), torch.from_numpy(mask), padding_side=side)[0])
    ours = np.linalg.norm(v2 - v) / np.linalg.norm(v)
    theirs = np.linalg.norm(rv2 - rv) / np.linalg.norm(rv)
    print(f"prompt sensitivity: vidax {ours:.4f}, reference {theirs:.4f}")
    assert abs(ours / theirs - 1) < 1e-3


def test_audio_vae_and_vocoders(tmp_path):
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    for i, over in enumerate([{}, dict(norm_type="group", causality_axis="none", attn_resolutions=(8,),
                                       mid_block_add_attention=True, base_channels=32)]):
        cfg = {**dict(base_channels=8, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4, mel_bins=16, resolution=16), **over}
        ref = perturb(AutoencoderKLLTX2Audio(**cfg), seed=1)
        m = _save(ref, tmp_path / f"vae{i}")
        z = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
        with torch.no_grad():
            rd = to_numpy(ref.decode(torch.from_numpy(z)).sample)
        assert_parity(m.decode(z), rd, what=f"AutoencoderKLLTX2Audio decode {over or 'causal pixel-norm'}")
        x = rng.standard_normal((2, 2, 17, 16)).astype(np.float32)
        with torch.no_grad():
            re = to_numpy(ref.encode(torch.from_numpy(x)).latent_dist.mode())
        assert_parity(m.encode(x), re, what=f"AutoencoderKLLTX2Audio encode {over or 'causal pixel-norm'}")
    voc = dict(in_channels=8, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
               resnet_kernel_sizes=[3, 5], resnet_dilations=[[1, 3], [1, 2]])
    ref = perturb(LTX2Vocoder(**voc), seed=2)
    m = _save(ref, tmp_path / "voc")
    mel = rng.standard_normal((2, 2, 9, 4)).astype(np.float32)
    with torch.no_grad():
        r = to_numpy(ref(torch.from_numpy(mel)))
    assert_parity(m.forward(mel), r, what="LTX2Vocoder")
    bwe = dict(voc, resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]], bwe_in_channels=8, bwe_hidden_channels=16,
               bwe_upsample_kernel_sizes=[5, 8], bwe_upsample_factors=[3, 4], bwe_resnet_kernel_sizes=[3],
               bwe_resnet_dilations=[[1, 2]], filter_length=16, hop_length=4, window_length=16, num_mel_channels=4)
    ref = perturb(LTX2VocoderWithBWE(**bwe), seed=3)
    with torch.no_grad():  # a Hann-windowed DFT basis and a positive mel filterbank, as trained ones are
        n, k = np.arange(16), np.arange(9)[:, None]
        win = np.hanning(17)[:-1]
        basis = np.concatenate([np.cos(2 * np.pi * k * n / 16) * win, -np.sin(2 * np.pi * k * n / 16) * win], 0)
        ref.mel_stft.stft_fn.forward_basis.copy_(torch.from_numpy(basis.astype(np.float32)[:, None, :]))
        ref.mel_stft.mel_basis.copy_(torch.rand(4, 9))
        for mod in (ref.vocoder, ref.bwe_generator):
            mod.conv_out.weight.mul_(0.05)
    m = _save(ref, tmp_path / "bwe")
    with torch.no_grad():
        r = to_numpy(ref(torch.from_numpy(mel)))
    assert np.mean(np.abs(r) < 0.99) > 0.5  # mostly not clamped
    assert_parity(m.forward(mel), r, what="LTX2VocoderWithBWE")


DD = dict(latent_channels=8, decoder_head_dim=8, decoder_stage_channels=(32, 16, 16, 16, 16), decoder_stage_depths=(1, 1, 1, 1,
                                                                                                                    2),
          decoder_stage_kernels=((3, 1, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3)), decoder_upsample_channel_reductions=(2, 1, 1, 1),
          decoder_stage5_kernel=(3, 5, 3), decoder_t_emb_dim=16)


@pytest.fixture(scope="module")
def diffusion_decoder(tmp_path_factory):
    from diffusers import LTX2VideoDiffusionDecoderModel

    torch.manual_seed(0)
    ref = perturb(LTX2VideoDiffusionDecoderModel(**DD), seed=1)
    path = tmp_path_factory.mktemp("dd")
    ref.save_pretrained(path)
    return ref, path


def test_diffusion_decoder_denoise(diffusion_decoder):
    """``denoise(z, x_t, steps)``: the reference's stages 1-4 then its stage-5 loop from the given
    pixel noise; one x0 step (as LTX-2.5 ships) and two Euler steps; tile sizes do not matter."""
    ref, path = diffusion_decoder
    m = compat.load_pretrained(path)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 8, 2, 2, 2)).astype(np.float32)
    dec = ref.decoder
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ctx = dec.forward_stage_4(dec.forward_stages_1_to_3(torch.from_numpy(z)))
        xt = torch.from_numpy(rng.standard_normal((2, 3, ctx.shape[1], ctx.shape[2] * 4, ctx.shape[3] * 4)).astype(np.float32))
        r1, r2 = to_numpy(dec.denoise(ctx, xt, 1)), to_numpy(dec.denoise(ctx[:1], xt[:1], 2))
    assert_parity(m.denoise(z, xt.numpy(), 1), r1, what="LTX2VideoDiffusionDecoderModel denoise, 1 step")
    assert_parity(m.denoise(z[:1], xt.numpy()[:1], 2, tile=(2, 3, 5)), r2,
                  what="LTX2VideoDiffusionDecoderModel denoise, 2 Euler steps")


def test_diffusion_decoder_tensor_parallel(diffusion_decoder):
    """Heads and SwiGLU widths split over tp=2 (the compiler partitions the jitted decode): the same
    pixels as one device from the same seeded noise, and each device holds part of the weights."""
    import jax

    _, path = diffusion_decoder
    one = compat.load_pretrained(path)
    tp = compat.load_pretrained(path, mesh="tp=2")
    z = np.random.default_rng(1).standard_normal((1, 8, 2, 2, 2)).astype(np.float32)
    key = jax.random.key(7)
    a, b = one.decode(z, key), tp.decode(z, key)
    np.testing.assert_array_equal(one.decode(z, key), a)  # the noise is the key's
    err = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    print(f"tp=2 vs one device: rel err {err:.2e}")
    assert err <= 1e-5
    leaf = tp.split.state["blocks"]["mlp"]["up"]["kernel"][...]
    assert len(leaf.sharding.device_set) == 2 and leaf.sharding.shard_shape(leaf.shape)[-1] == leaf.shape[-1] // 2


def test_neighborhood_attention_is_exact():
    """The tiled windowed attention equals dense attention with NATTEN's window mask (windows
    shifted inward at the borders), for tiles that do not divide the grid."""
    import jax
    import jax.numpy as jnp

    from vidax.models.ltx.diffusion_decoder import _window_starts, neighborhood_attention

    rng = np.random.default_rng(0)
    t, h, w, kern = 5, 7, 6, (3, 5, 3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, w, 2, 4)), jnp.float32) for _ in range(3))
    out = neighborhood_attention(q, k, v, kern, tile=(2, 3, 4))
    pos = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"), -1).reshape(-1, 3)
    st = np.stack([_window_starts(n, kk)[pos[:, a]] for a, (n, kk) in enumerate(zip((t, h, w), kern))], -1)
    mask = np.all((pos[None, :, :] >= st[:, None, :]) & (pos[None, :, :] < st[:, None, :] + np.asarray(kern)), -1)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.reshape(1, -1, 2, 4), k.reshape(1, -1, 2, 4), precision="highest")
    p = jax.nn.softmax(jnp.where(mask[None, None], s, -jnp.inf), -1)
    dense = jnp.einsum("bhqk,bkhd->bqhd", p, v.reshape(1, -1, 2, 4), precision="highest").reshape(out.shape)
    assert mask.sum(1).min() == mask.sum(1).max() == np.prod(kern)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=2e-6)
