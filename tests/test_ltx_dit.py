"""LTX-Video 0.9 DiT (``LTXVideoTransformer3DModel``): parity with diffusers (T2V, per-token I2V
timesteps, masks, precomputed coordinates, original release names), compile count, load errors,
and tp / sp / tp+sp / offload equal to one device."""
import jax
import numpy as np
import pytest
import torch

from tests import sweep
from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.weights import CheckpointMismatchError, save_safetensors

TINY = dict(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=10, cross_attention_dim=40,
            num_layers=2, caption_channels=20)


@pytest.fixture(scope="module")
def ref_folder(tmp_path_factory):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    ref = perturb(LTXVideoTransformer3DModel(**TINY), seed=1)
    path = tmp_path_factory.mktemp("ltx_dit")
    ref.save_pretrained(path)
    return ref, path


def _inputs(b=2, f=3, h=4, w=5, lt=6, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((b, lt), np.int64)
    mask[1, 4:] = 0  # the second prompt is shorter: padded keys are masked
    return dict(hidden_states=rng.standard_normal((b, f * h * w, TINY["in_channels"])).astype(np.float32),
                encoder_hidden_states=rng.standard_normal((b, lt, TINY["caption_channels"])).astype(np.float32),
                timestep=np.array([999.0, 321.5][:b], np.float32), encoder_attention_mask=mask,
                num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32))


def _run_ref(model, kw):
    tkw = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    with torch.no_grad():
        return to_numpy(model(**tkw, return_dict=False)[0])


def test_t2v_parity_with_mask(ref_folder):
    ref, path = ref_folder
    kw = _inputs()
    out = compat.load_pretrained(path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="LTXVideoTransformer3DModel T2V (masked text)")


def test_per_token_timesteps_and_video_coords(ref_folder):
    """Image-to-video: one timestep per token (0 on the known first frame); coordinates given
    precomputed as the reference takes them."""
    ref, path = ref_folder
    kw = _inputs(f=2, h=3, w=4)
    s = 2 * 3 * 4
    t = np.tile(np.array([[900.0], [250.0]], np.float32), (1, s))
    t[:, :12] = 0.0
    kw["timestep"] = t
    rng = np.random.default_rng(5)
    kw["video_coords"] = (rng.uniform(0, 40, (2, 3, s))).astype(np.float32)
    out = compat.load_pretrained(path).forward(**kw)
    assert_parity(out, _run_ref(ref, kw), what="LTXVideoTransformer3DModel per-token t, video_coords")


def test_original_release_names(ref_folder, tmp_path):
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

    from vidax.models.ltx.dit import LTXDiTConfig, diffusers_keymap, forward, load_dit, model_inputs, original_keymap, \
        rope_tables, video_coords

    ref, _ = ref_folder
    sd = {k: to_numpy(v) for k, v in ref.state_dict().items()}
    cfg = LTXDiTConfig.from_diffusers(dict(ref.config))
    ren = diffusers_keymap(cfg).rename(sd, original_keymap(cfg))
    orig = {"model.diffusion_model." + ren[k]: v for k, v in sd.items()}
    back = convert_ltx_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in orig.items()})
    assert sorted(back) == sorted(sd)  # diffusers' own converter gives the diffusers names back
    save_safetensors(orig, tmp_path / "ltx-video-2b-v0.9.safetensors")
    state, cfg2 = load_dit(tmp_path / "ltx-video-2b-v0.9.safetensors", cfg)
    kw = _inputs()
    cos, sin = rope_tables(video_coords(3, 4, 5, kw["rope_interpolation_scale"], cfg2), cfg2)
    inp = model_inputs(cfg2, kw["hidden_states"], kw["timestep"], kw["encoder_hidden_states"],
                       kw["encoder_attention_mask"], cos, sin)
    out = np.asarray(jax.jit(forward, static_argnums=1)(jax.device_put(state), cfg2, inp)["y"])
    assert_parity(out, _run_ref(ref, kw), what="LTX DiT from original names")


def test_forward_compiles_once(ref_folder):
    from vidax.core.jit import CompileCounter

    _, path = ref_folder
    m = compat.load_pretrained(path)
    kw = _inputs()
    m.forward(**kw)
    with CompileCounter() as cc:
        for i in range(5):
            m.forward(**{**kw, "timestep": kw["timestep"] - 10 * i})
    assert cc.count == 0


def test_mismatched_checkpoint_is_reported(ref_folder, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    _, path = ref_folder
    shutil.copytree(path, tmp_path / "m")
    f = tmp_path / "m" / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "transformer_blocks.1.attn2.to_k.weight"
    sd[key] = sd[key][:, :-1].copy()
    del sd["transformer_blocks.0.ff.net.2.bias"]
    save_file(sd, f)
    with pytest.raises(CheckpointMismatchError) as e:
        compat.load_pretrained(tmp_path / "m")
    msg = str(e.value)
    assert key in msg and "transformer_blocks.0.ff.net.2.bias" in msg and "1 missing" in msg and "1 mis-shaped" in msg


@pytest.mark.parametrize("mesh,chunk", sweep.sample([("tp=2", None), ("sp=2", None), ("dp=2,tp=2,sp=2", None),
                                                     (None, 1), ("tp=2,sp=2", 1)], 3, "ltx-meshes"))
def test_scale_equals_one_device(ref_folder, mesh, chunk):
    _, path = ref_folder
    kw = _inputs(f=2, h=4, w=4)
    one = compat.load_pretrained(path).forward(**kw)
    out = compat.load_pretrained(path, mesh=mesh or "tp=1", offload_chunk_size=chunk).forward(**kw)
    err = float(np.max(np.abs(out - one)) / np.max(np.abs(one)))
    print(f"mesh={mesh} offload={chunk}: rel err {err:.2e}")
    assert err <= 1e-5


def test_indivisible_tokens_run_padded(ref_folder):
    """15 tokens on sp=2: padded (and masked) inside the program, the same as one device."""
    _, path = ref_folder
    kw = _inputs(f=1, h=3, w=5)
    one = compat.load_pretrained(path).forward(**kw)
    out = compat.load_pretrained(path, mesh="sp=2").forward(**kw)
    assert out.shape == one.shape and np.max(np.abs(out - one)) <= 1e-5 * np.max(np.abs(one))
