"""HunyuanVideo 1.5 DiT: parity with diffusers' HunyuanVideo15Transformer3DModel (T2V: all-zero
image embeddings; I2V: SigLIP tokens + 65-channel latents), meanflow, the original release's
names, the reordering of the condition tokens, compile count and loading errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.hunyuan_original import hunyuanvideo15_original_names
from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.core.jit import CompileCounter
from vidax.models.hunyuanvideo15 import convert, dit
from vidax.weights import CheckpointMismatchError, save_safetensors

TINY = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_refiner_layers=2, mlp_ratio=3.0, patch_size=1, patch_size_t=1, text_embed_dim=24, text_embed_2_dim=20,
            image_embed_dim=12, rope_axes_dim=(4, 6, 6))
VARIANTS = {"t2v": dict(task_type="t2v"), "i2v": dict(task_type="i2v"), "meanflow": dict(task_type="t2v", use_meanflow=True)}


def _inputs(variant, b=2, seed=0):
    """B=2 with different timesteps, text and glyph padding per row; a non-square 3x6x8 latent."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    kw = dict(hidden_states=r(b, 9, 3, 6, 8), timestep=np.array([999.0, 321.5], np.float32)[:b],
              encoder_hidden_states=r(b, 7, 24),
              encoder_attention_mask=np.array([[1] * 5 + [0] * 2, [1] * 3 + [0] * 4], np.float32)[:b],
              encoder_hidden_states_2=r(b, 6, 20),
              encoder_attention_mask_2=np.array([[1] * 4 + [0] * 2, [0] * 6], np.float32)[:b],
              image_embeds=r(b, 5, 12) if variant == "i2v" else np.zeros((b, 5, 12), np.float32))
    if variant == "meanflow":
        kw["timestep_r"] = np.array([500.0, 100.0], np.float32)[:b]
    return kw


def _run_ref(model, kw):
    with torch.no_grad():
        return to_numpy(model(**{k: torch.from_numpy(v) for k, v in kw.items()}, return_dict=False)[0])


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    from diffusers import HunyuanVideo15Transformer3DModel

    out = {}
    for name, over in VARIANTS.items():
        torch.manual_seed(0)
        m = perturb(HunyuanVideo15Transformer3DModel(**{**TINY, **over}), seed=1)
        folder = tmp_path_factory.mktemp(f"hv15_{name}")
        m.save_pretrained(folder)
        kw = _inputs(name)
        out[name] = (m, folder, kw, _run_ref(m, kw))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(refs, variant):
    _, folder, kw, ref = refs[variant]
    out = compat.load_pretrained(folder).forward(**kw)
    assert_parity(out, ref, what=f"HunyuanVideo15Transformer3DModel {variant}")


def test_original_release_names(refs, tmp_path):
    """tencent/HunyuanVideo-1.5 names (``double_blocks``, ``byt5_in``, ``vision_in.proj.N``, the
    refiner's fused q/k/v, the final modulation as (shift, scale)): checked against diffusers' own
    conversion rules, then loaded and run."""
    model, _, kw, ref = refs["i2v"]
    sd = {k: to_numpy(v) for k, v in model.state_dict().items()}
    orig = hunyuanvideo15_original_names(sd)
    assert "byt5_in.fc3.weight" in orig and "vision_in.proj.4.bias" in orig and "cond_type_embedding.weight" in orig
    assert "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight" in orig
    assert "double_blocks.1.img_attn_q_norm.weight" in orig and "final_layer.adaLN_modulation.1.weight" in orig
    back = convert.original_to_diffusers(orig)
    assert set(back) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(np.asarray(back[k]), sd[k], err_msg=k)
    save_safetensors(orig, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match="head_dim 16"):  # the releases' 128 = 16 + 56 + 56 is the only inferable split
        dit.load_dit(tmp_path)
    state, cfg = dit.load_dit(tmp_path, dit.HunyuanVideo15Config.from_diffusers(dict(model.config)))
    args = _args(kw)
    assert_parity(np.asarray(jax.jit(dit.forward, static_argnums=1)(state, cfg, *args)).transpose(0, 4, 1, 2, 3), ref,
                  what="from the original release's names")


def _args(kw):
    return (jnp.asarray(kw["hidden_states"]).transpose(0, 2, 3, 4, 1), jnp.asarray(kw["timestep"]),
            jnp.asarray(kw["encoder_hidden_states"]), jnp.asarray(kw["encoder_attention_mask"]),
            jnp.asarray(kw["encoder_hidden_states_2"]), jnp.asarray(kw["encoder_attention_mask_2"]),
            jnp.asarray(kw["image_embeds"]))


def test_reorder_puts_valid_tokens_first():
    y = jnp.arange(2 * 6, dtype=jnp.float32).reshape(2, 6, 1)
    m = jnp.asarray([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 0, 1]], bool)
    out, n = dit.reorder([y[:, :2], y[:, 2:]], [m[:, :2], m[:, 2:]])
    assert n.tolist() == [3, 2]
    assert out[..., 0].tolist() == [[1, 3, 4, 0, 2, 5], [6, 11, 7, 8, 9, 10]]


def test_loading_errors(refs, tmp_path):
    from safetensors.numpy import load_file

    _, folder, _, _ = refs["t2v"]
    sd = load_file(str(folder / "diffusion_pytorch_model.safetensors"))
    sd["context_embedder_2.linear_1.weight"] = sd["context_embedder_2.linear_1.weight"][:, :3]
    del sd["cond_type_embed.weight"]
    save_safetensors(sd, tmp_path / "diffusion_pytorch_model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointMismatchError, match="cond_type_embed.weight") as e:
        dit.load_dit(tmp_path)
    assert "context_embedder_2.linear_1.weight" in str(e.value)


SCFG = dit.HunyuanVideo15Config(in_channels=9, out_channels=4, num_heads=8, head_dim=8, num_layers=2, num_refiner_layers=1,
                                mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=10, image_embed_dim=6,
                                rope_axes_dim=(2, 2, 4))


@pytest.fixture(scope="module")
def scale_setup():
    state = dit.init_state(SCFG, seed=0)
    rng = np.random.default_rng(0)
    r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    args = (r(2, 2, 8, 8, 9), jnp.asarray([999.0, 300.0]), r(2, 5, 16), jnp.asarray([[1, 1, 1, 0, 0], [1] * 5], jnp.float32),
            r(2, 4, 10), jnp.asarray([[1, 1, 0, 0], [0] * 4], jnp.float32), r(2, 3, 6))
    fwd = jax.jit(dit.forward, static_argnums=1)
    params = jax.tree.map(jnp.asarray, state)
    return state, args, np.asarray(fwd(params, SCFG, *args)), (fwd, params)


def _close(out, ref, what, tol=1e-5):
    e = float(np.max(np.abs(np.asarray(out, np.float64) - ref)) / np.max(np.abs(ref)))
    print(f"{what}: max abs err / max|ref| = {e:.2e}")
    assert e <= tol, what


@pytest.mark.parametrize("mesh,offload", [("tp=8", None), ("tp=2,sp=4", None), (None, 1)])
def test_scaled_equals_single_device(scale_setup, mesh, offload):
    """tp (heads, MLP, modulation columns split; row-parallel biases once), sp (Ulysses over the
    video tokens, the condition tokens whole), their composition and offloading of the stack
    equal the one-device forward (I2V image tokens: the condition reordering runs per device).
    Offloading on a mesh, through the pipeline's sampling: test_hunyuanvideo15_pipeline."""
    state, args, ref, _ = scale_setup
    r = dit.runner(state, SCFG, mesh, offload_chunk_size=offload)
    _close(r(*args), ref, f"HunyuanVideo 1.5 DiT mesh={mesh} offload={offload}")
    if offload is not None:
        p = r.offload.pools["double"]
        assert p.fn._cache_size() == 1 and p.num_chunks == SCFG.num_layers
    if mesh and "tp" in mesh and offload is None:
        tp = int(mesh.split("tp=")[1].split(",")[0])
        assert r.stacks["double"]["q"]["kernel"].get_value().addressable_shards[0].data.shape == (2, 64, 64 // tp)


def test_chunk_sizes():
    assert dit.parse_chunk_sizes("double=1", SCFG) == {"double": 1} == dit.parse_chunk_sizes({"double": 1}, SCFG)
    assert dit.parse_chunk_sizes("all", SCFG) == {"double": 2}
    with pytest.raises(ValueError, match="only pool is double"):
        dit.parse_chunk_sizes("single=1", SCFG)


def test_forward_compiles_once_over_ten_calls(scale_setup):
    _, args, _, (fwd, params) = scale_setup
    ts = [jnp.asarray(np.asarray(args[1]) - 10 * i) for i in range(10)]
    with CompileCounter() as cc:
        for t in ts:
            fwd(params, SCFG, args[0], t, *args[2:]).block_until_ready()
    assert cc.count == 0


def _diffusers_kwargs(cfg) -> dict:
    """The reference's constructor keywords for a vidax config."""
    return dict(in_channels=cfg.in_channels, out_channels=cfg.out_channels, num_attention_heads=cfg.num_heads,
                attention_head_dim=cfg.head_dim, num_layers=cfg.num_layers,
                num_refiner_layers=cfg.num_refiner_layers, mlp_ratio=cfg.mlp_ratio, patch_size=cfg.patch_size,
                patch_size_t=cfg.patch_size_t, qk_norm=cfg.qk_norm, text_embed_dim=cfg.text_embed_dim,
                text_embed_2_dim=cfg.text_embed_2_dim, image_embed_dim=cfg.image_embed_dim,
                rope_theta=cfg.rope_theta, rope_axes_dim=cfg.rope_axes_dim, target_size=cfg.target_size,
                task_type=cfg.task_type, use_meanflow=cfg.use_meanflow)


def test_release_configs_map_every_tensor():
    """The 8.3B release DiT (and the release VAE): every tensor of the reference built on the meta
    device maps onto a vidax parameter of the right shape, and none is left over (shapes only)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    from vidax.models.hunyuanvideo15 import vae as hvae
    from vidax.weights import load_params

    class Checked(Exception):
        pass

    class Shape:  # a tensor's shape; reading it means every name and shape matched
        def __init__(self, shape):
            self.shape = tuple(shape)

        def __array__(self, *a, **k):
            raise Checked

    cfg = dit.PRESETS["720p-i2v"]
    with torch.device("meta"):
        ref = HunyuanVideo15Transformer3DModel(**_diffusers_kwargs(cfg))
        ref_vae = AutoencoderKLHunyuanVideo15()
    sd = {k: Shape(v.shape) for k, v in ref.state_dict().items()}
    shapes = dit.param_shapes(cfg)
    assert sum(int(np.prod(v.shape)) for v in sd.values()) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    with pytest.raises(Checked):
        load_params(sd, convert.diffusers_keymap(cfg), shapes)
    vc = hvae.HunyuanVideo15VAEConfig()
    with pytest.raises(Checked):
        load_params({k: Shape(v.shape) for k, v in ref_vae.state_dict().items()}, hvae.keymap(vc), hvae.param_shapes(vc))
