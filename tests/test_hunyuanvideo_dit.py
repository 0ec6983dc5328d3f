"""HunyuanVideo DiT: parity with diffusers' HunyuanVideoTransformer3DModel (T2V, token_replace and
latent_concat I2V), the original release's names, tp / sp / two-pool offload parity on 8 fake
devices, compile counts and loading errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.hunyuan_original import hunyuanvideo_original_names
from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.core import sharding as vsh
from vidax.core.jit import CompileCounter
from vidax.models.hunyuanvideo import dit
from vidax.weights import CheckpointMismatchError, save_safetensors

TINY = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=2,
            num_refiner_layers=2, mlp_ratio=3.0, patch_size=2, patch_size_t=1, text_embed_dim=24,
            pooled_projection_dim=20, rope_axes_dim=(4, 6, 6))
VARIANTS = {"t2v": {}, "token_replace": dict(image_condition_type="token_replace"),
            "latent_concat": dict(image_condition_type="latent_concat", in_channels=9, guidance_embeds=False)}


def _inputs(cin, b=2, seed=0):
    """B=2 with different timesteps, guidance and text padding per row; a non-square 3x6x8 latent."""
    rng = np.random.default_rng(seed)
    return dict(hidden_states=rng.standard_normal((b, cin, 3, 6, 8)).astype(np.float32),
                timestep=np.array([999.0, 321.5], np.float32)[:b],
                encoder_hidden_states=rng.standard_normal((b, 7, 24)).astype(np.float32),
                encoder_attention_mask=np.array([[1] * 5 + [0] * 2, [1] * 3 + [0] * 4], np.float32)[:b],
                pooled_projections=rng.standard_normal((b, 20)).astype(np.float32),
                guidance=np.array([6000.0, 3500.0], np.float32)[:b])


def _run_ref(model, kw):
    with torch.no_grad():
        return to_numpy(model(**{k: torch.from_numpy(v) for k, v in kw.items()}, return_dict=False)[0])


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    from diffusers import HunyuanVideoTransformer3DModel

    out = {}
    for name, over in VARIANTS.items():
        torch.manual_seed(0)
        m = perturb(HunyuanVideoTransformer3DModel(**{**TINY, **over}), seed=1)
        folder = tmp_path_factory.mktemp(f"hv_{name}")
        m.save_pretrained(folder)
        kw = _inputs(over.get("in_channels", 4))
        out[name] = (m, folder, kw, _run_ref(m, kw))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(refs, variant):
    _, folder, kw, ref = refs[variant]
    out = compat.load_pretrained(folder).forward(**kw)
    assert_parity(out, ref, what=f"HunyuanVideoTransformer3DModel {variant}")


def test_original_release_names(refs, tmp_path):
    """The tencent release's names (fused q/k/v, fused single-block linear1, (shift, scale) final
    modulation, ``txt_in`` refiner) in a ``.pt`` with a ``module`` key, as mp_rank_00_model_states.pt."""
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    model = refs["t2v"][0]
    sd = {k: to_numpy(v) for k, v in model.state_dict().items()}
    cfg = dit.HunyuanVideoConfig.from_diffusers(dict(model.config))
    orig = hunyuanvideo_original_names(cfg, sd)
    assert any(k.startswith("double_blocks.0.img_attn_qkv") for k in orig) and "single_blocks.0.linear1.weight" in orig
    # independent check of the names: diffusers' own converter maps them back (its single-block
    # split hard-codes the 13B width, so the fused linear1 is checked by our loader below)
    part = {k: torch.from_numpy(v) for k, v in orig.items() if ".linear1." not in k}
    back = convert_hunyuan_video_transformer_to_diffusers(dict(part))
    for k, v in back.items():
        np.testing.assert_array_equal(v.numpy(), sd[k], err_msg=k)
    assert set(back) == {k for k in sd if not (k.startswith("single_transformer_blocks.")
                                                and (".attn.to_" in k or ".proj_mlp." in k))}
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {k: torch.from_numpy(v) for k, v in orig.items()}}, path)
    with pytest.raises(ValueError, match="rope_axes_dim cannot be inferred"):
        dit.load_dit(path)  # the release's geometry (head_dim 128) is inferred; a tiny one needs its config
    state, _ = dit.load_dit(path, cfg)
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(state))
    # every parameter equal to the diffusers folder's (whose forward matches the reference above)
    want, _ = dit.load_dit(refs["t2v"][1], cfg)
    for p, a, b in zip(vsh.tree_paths(want), jax.tree.leaves(want), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b, err_msg=p)
    save_safetensors(orig, tmp_path / "hunyuan.safetensors")
    state2, _ = dit.load_dit(tmp_path / "hunyuan.safetensors", cfg)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fault", ["missing", "misshaped"])
def test_mismatched_checkpoint_is_reported(refs, tmp_path, fault):
    from safetensors.numpy import load_file, save_file

    _, folder, _, _ = refs["t2v"]
    import shutil

    shutil.copytree(folder, tmp_path / "m")
    f = tmp_path / "m" / "diffusion_pytorch_model.safetensors"
    sd = load_file(f)
    key = "single_transformer_blocks.1.attn.to_q.weight"
    if fault == "missing":
        del sd[key]
    else:
        sd[key] = sd[key][:, :-1].copy()
    save_file(sd, f)
    with pytest.raises(CheckpointMismatchError) as e:
        compat.load_pretrained(tmp_path / "m")
    assert key in str(e.value) and {"missing": "1 missing", "misshaped": "1 mis-shaped"}[fault] in str(e.value)


# ----------------------------------------------------------------------------------- scale
SCFG = dit.HunyuanVideoConfig(in_channels=4, out_channels=4, num_heads=8, head_dim=8, num_layers=2, num_single_layers=4,
                              num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, pooled_projection_dim=12,
                              rope_axes_dim=(2, 2, 4), image_condition_type="token_replace")


@pytest.fixture(scope="module")
def scale_setup():
    state = dit.init_state(SCFG, seed=0)
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((2, 2, 8, 8, 4)), jnp.float32), jnp.asarray([999.0, 300.0]),
            jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32), jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]],
                                                                                   jnp.float32),
            jnp.asarray(rng.standard_normal((2, 12)), jnp.float32), jnp.asarray([6000.0, 2000.0]))
    fwd = jax.jit(dit.forward, static_argnums=1)
    params = jax.tree.map(jnp.asarray, state)
    return state, args, np.asarray(fwd(params, SCFG, *args)), (fwd, params)


def _close(out, ref, what, tol=1e-5):
    e = float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))
    print(f"{what}: max abs err / max|ref| = {e:.2e}")
    assert e <= tol, what


def test_logical_axes_give_megatron_layout():
    specs = nnx.to_pure_dict(vsh.param_specs(dit.abstract_state(SCFG), vsh.axis_rules("tp", dit.DualStreamHooks.AXIS_DELTAS)))
    d, s = specs["double"], specs["single"]
    for n in ("q", "k", "v", "add_q", "add_k", "add_v"):
        assert d[n]["kernel"] == P(None, None, "tp") and d[n]["bias"] == P(None, "tp")  # column-parallel
    for n in ("o", "add_o", "ff_down", "ffc_down"):
        assert d[n]["kernel"] == P(None, "tp") and d[n]["bias"] == P()  # row-parallel, bias whole
    assert d["mod"]["kernel"] == P(None, None, "tp") and s["mod"]["kernel"] == P(None, None, "tp")
    # the single block's proj_out over [attention; MLP]: two row-parallel kernels, one bias
    assert s["out_attn"]["kernel"] == P(None, "tp") and s["out_mlp"]["kernel"] == P(None, "tp")
    assert s["out_attn"]["bias"] == P() and "bias" not in s["out_mlp"]
    assert s["mlp"]["kernel"] == P(None, None, "tp") and d["norm_q"]["scale"] == P()
    assert all(p == P() for p in jax.tree.leaves(specs["embed"], is_leaf=lambda x: isinstance(x, P)))


@pytest.mark.parametrize("mesh", ["tp=8", "sp=8", "tp=2,sp=4"])
def test_sharded_equals_single_device(scale_setup, mesh):
    """Tensor / sequence parallelism equal the one-device forward (token_replace config: with
    sp=8 the first latent frame's tokens are spread over 4 devices; the text stays whole)."""
    state, args, ref, _ = scale_setup
    r = dit.runner(state, SCFG, mesh)
    _close(r(*args), ref, f"HunyuanVideo DiT mesh={mesh}")
    tp = int(mesh.split("tp=")[1].split(",")[0]) if "tp" in mesh else 1
    q = r.stacks["double"]["q"]["kernel"].get_value()
    assert q.addressable_shards[0].data.shape == (SCFG.num_layers, SCFG.dim, SCFG.dim // tp)
    mod = r.stacks["single"]["mod"]["kernel"].get_value()
    assert mod.addressable_shards[0].data.shape == (SCFG.num_single_layers, SCFG.dim, 3 * SCFG.dim // tp)


@pytest.mark.parametrize("mesh,offload", [(None, "double=1,single=2"), ("tp=2,sp=2", "double=2,single=1")])
def test_two_offload_pools(scale_setup, mesh, offload):
    """Each block stack streams through its own pool with its own chunk size and ONE compiled
    chunk program; composed with tp x sp; equal to the resident one-device forward."""
    state, args, ref, _ = scale_setup
    r = dit.runner(state, SCFG, mesh, offload_chunk_size=offload)
    _close(r(*args), ref, f"HunyuanVideo DiT mesh={mesh} offload={offload}")
    pools = r.offload.pools
    sizes = dict(p.split("=") for p in offload.split(","))
    assert {k: pools[k].chunk_size for k in ("double", "single")} == {k: int(v) for k, v in sizes.items()}
    ts = [jnp.asarray(np.asarray(args[1]) + s) for s in range(2)]
    with CompileCounter() as cc:
        for t in ts:
            r(args[0], t, *args[2:]).block_until_ready()
    assert cc.count == 0
    for k in ("double", "single"):
        assert pools[k].fn._cache_size() == 1 and pools[k].transfers == 3 * pools[k].num_chunks
        assert jax.tree.leaves(pools[k].host_chunks[0])[0].sharding.memory_kind == "pinned_host"


def test_chunk_sizes_per_pool():
    assert dit.parse_chunk_sizes("double=2,single=all", SCFG) == {"double": 2, "single": 4}
    assert dit.parse_chunk_sizes(2, SCFG) == {"double": 2, "single": 2}
    assert dit.parse_chunk_sizes({"single": 1}, SCFG) == {"double": 2, "single": 1}
    with pytest.raises(ValueError, match="double blocks: offload_chunk_size=3 does not divide num_layers=2.*double=N,single=M"):
        dit.parse_chunk_sizes(3, SCFG)
    with pytest.raises(ValueError, match="unknown pools"):
        dit.parse_chunk_sizes({"triple": 1}, SCFG)
    with pytest.raises(ValueError, match="expected pools"):
        dit.parse_chunk_sizes("double=x", SCFG)


def test_forward_compiles_once_over_ten_calls(scale_setup):
    _, args, _, (fwd, params) = scale_setup
    ts = [jnp.asarray(np.asarray(args[1]) - 10 * i) for i in range(10)]
    with CompileCounter() as cc:
        for t in ts:
            fwd(params, SCFG, args[0], t, *args[2:]).block_until_ready()
    assert cc.count == 0
