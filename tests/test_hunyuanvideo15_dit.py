"""HunyuanVideo 1.5 DiT: parity with diffusers' HunyuanVideo15Transformer3DModel (T2V: all-zero
image embeddings; I2V: SigLIP tokens + 65-channel latents), meanflow, the original release's
names, the reordering of the condition tokens, compile count and loading errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity, perturb, to_numpy
from vidax import compat
from vidax.core.jit import CompileCounter
from vidax.models.hunyuanvideo15 import dit
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
