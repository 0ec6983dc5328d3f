"""LoRA adapters: merged at load, against diffusers' ``load_lora_weights`` + ``fuse_lora``.

One tiny complete Wan diffusers folder (UMT5 text encoder, word-level tokenizer, DiT, VAE) is
built once per module; each LoRA layout is checked against the folder whose transformer diffusers
fused, end to end through ``vidax generate`` for the PEFT layout and on the loaded DiT tensors for
the others."""
import json
import shutil

import numpy as np
import pytest
import torch

from tests.refutil import perturb

DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
           text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=64)
VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
WORDS = "a red kite over the sea at dawn lighthouse storm panda".split()
RANK = 4


def _tokenizer(folder):
    from tokenizers import Tokenizer, models

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz\u2581"]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5TokenizerFast",
                                                              "pad_token": "<pad>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """A complete tiny Wan2.1 T2V diffusers folder."""
    import transformers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    transformer = perturb(WanTransformer3DModel(**DIT), seed=1)
    vae = perturb(AutoencoderKLWan(**VAE), seed=2)
    te = perturb(transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8)), seed=3)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=sched)
    folder = tmp_path_factory.mktemp("wan_full")
    pipe.save_pretrained(folder)
    te.save_pretrained(folder / "text_encoder")
    _tokenizer(folder / "tokenizer")
    index = json.loads((folder / "model_index.json").read_text())
    index.update(text_encoder=["transformers", "UMT5EncoderModel"], tokenizer=["transformers", "T5TokenizerFast"])
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


# ------------------------------------------------------------------ LoRA files in each layout
def _modules(layers=2):
    """(diffusers module, original module, out, in) of every adaptable linear layer."""
    d, f = 24, 48
    out = []
    for i in range(layers):
        for a, oa in (("attn1", "self_attn"), ("attn2", "cross_attn")):
            for n, on in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o")):
                out.append((f"blocks.{i}.{a}.{n}", f"blocks.{i}.{oa}.{on}", d, d))
        out.append((f"blocks.{i}.ffn.net.0.proj", f"blocks.{i}.ffn.0", f, d))
        out.append((f"blocks.{i}.ffn.net.2", f"blocks.{i}.ffn.2", d, f))
    return out


def make_lora(layout: str, seed: int = 0, modules=None) -> dict[str, np.ndarray]:
    """A random LoRA in ``layout``: peft | kohya | aitoolkit | musubi | lycoris (kohya + diff_b)."""
    rng = np.random.default_rng(seed)
    sd = {}
    for dn, on, o, i in modules or _modules():
        down = (0.3 * rng.standard_normal((RANK, i))).astype(np.float32)
        up = (0.3 * rng.standard_normal((o, RANK))).astype(np.float32)
        alpha = np.asarray(2.0, np.float32)
        if layout == "peft":
            sd[f"transformer.{dn}.lora_A.weight"], sd[f"transformer.{dn}.lora_B.weight"] = down, up
        elif layout == "aitoolkit":
            sd[f"diffusion_model.{on}.lora_A.weight"], sd[f"diffusion_model.{on}.lora_B.weight"] = down, up
        elif layout in ("kohya", "lycoris"):
            sd[f"diffusion_model.{on}.lora_down.weight"], sd[f"diffusion_model.{on}.lora_up.weight"] = down, up
            sd[f"diffusion_model.{on}.alpha"] = alpha
            if layout == "lycoris":
                sd[f"diffusion_model.{on}.diff_b"] = (0.2 * rng.standard_normal(o)).astype(np.float32)
        elif layout == "musubi":
            flat = "lora_unet_" + on.replace(".", "_")
            sd[f"{flat}.lora_down.weight"], sd[f"{flat}.lora_up.weight"], sd[f"{flat}.alpha"] = down, up, alpha
        else:
            raise ValueError(layout)
    return sd


def _save(sd, path):
    from safetensors.numpy import save_file

    save_file(sd, str(path))
    return path


def fused_transformer(folder, lora_path, scale, dst=None):
    """diffusers: load_lora_weights + fuse_lora(lora_scale) + unload; the fused state dict (and, with
    ``dst``, a copy of ``folder`` whose transformer is the fused one)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    tr = WanTransformer3DModel.from_pretrained(folder / "transformer")
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=tr, vae=None, scheduler=None)
    pipe.load_lora_weights(str(lora_path))
    pipe.fuse_lora(lora_scale=scale)
    pipe.unload_lora_weights()
    sd = {k: v.detach().numpy().copy() for k, v in tr.state_dict().items()}
    if dst is not None:
        shutil.copytree(folder, dst)
        shutil.rmtree(dst / "transformer")
        tr.save_pretrained(dst / "transformer")
    return sd


def _vidax_dit(folder, specs):
    """vidax's loaded DiT state (reference names) with ``specs`` merged."""
    from vidax.models.wan import dit as wdit
    from vidax.models.wan import lora as wlora
    from vidax.weights import lora as vlora
    from vidax.weights import open_checkpoint

    path = folder / "transformer"
    cfg = wdit.WanDiTConfig.from_diffusers(json.loads((path / "config.json").read_text()))
    with vlora.merging(wlora.target("dit", path, cfg, "Wan DiT"), [vlora.parse_spec(s) for s in specs]):
        ckpt = open_checkpoint(path)
        merged = {k: ckpt[k].read() for k in ckpt}
    state, _ = None, None
    with vlora.merging(wlora.target("dit", path, cfg, "Wan DiT"), [vlora.parse_spec(s) for s in specs]):
        state, _ = wdit.load_dit(path, cfg)
    return merged, state


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(1e-12, float(np.max(np.abs(b)))))


# ------------------------------------------------------------------ (a) end to end, PEFT layout
def _generate(store, checkpoint, lora=None, **over):
    from stages import cli
    from stages.store import RunStore, read_array

    args = ["generate", "--model", "wan2.1-t2v-1.3b", "--checkpoint", str(checkpoint), "--prompt", "a red kite",
            "--height", "32", "--width", "32", "--frames", "5", "--steps", "2", "--guidance", "3",
            "--scheduler", "unipc", "--shift", "3", "--decode-stages", "1", "--run-id", "r", "--store", str(store)]
    for k, v in over.items():
        args += [f"--{k}", str(v)]
    for spec in lora or ():
        args += ["--lora", spec]
    assert cli.main(args) == 0
    return read_array(RunStore(str(store)).run("r").group("sample.zarr"), "latents")


def test_peft_lora_end_to_end_matches_diffusers_fused_folder(wan_folder, tmp_path):
    lora = _save(make_lora("peft", seed=1), tmp_path / "style.safetensors")
    fused = tmp_path / "fused"
    sd = fused_transformer(wan_folder, lora, 0.7, dst=fused)
    base = {k: v.detach().numpy() for k, v in
            __import__("diffusers").WanTransformer3DModel.from_pretrained(wan_folder / "transformer").state_dict().items()}
    moved = _rel(sd["blocks.0.attn1.to_q.weight"], base["blocks.0.attn1.to_q.weight"])
    assert moved > 0.05, f"the LoRA barely changes the weights ({moved:.2e}): a weak test"
    ours = _generate(tmp_path / "s1", wan_folder, [f"{lora}:0.7"])
    ref = _generate(tmp_path / "s2", fused)
    err = _rel(ours, ref)
    print(f"latents rel err {err:.2e}")
    assert err <= 1e-5, f"latents differ from the fused folder's: {err:.2e} relative"
    plain = _generate(tmp_path / "s3", wan_folder)
    assert _rel(plain, ref) > 1e-3  # the LoRA changes the result


# ------------------------------------------------------------------ (b) the other layouts
@pytest.mark.parametrize("layout", ["peft", "kohya", "aitoolkit", "musubi", "lycoris"])
def test_layouts_merge_as_diffusers_fuses(wan_folder, tmp_path, layout):
    lora = _save(make_lora(layout, seed=2), tmp_path / f"{layout}.safetensors")
    ref = fused_transformer(wan_folder, lora, 0.6)
    merged, state = _vidax_dit(wan_folder, [f"{lora}:0.6"])
    assert set(merged) == set(ref)
    worst = max(_rel(merged[k], ref[k]) for k in ref)
    assert worst <= 1e-5, f"{layout}: max relative error {worst:.2e}"
    # and through the key map into the stacked kernels ([in, out], layer-stacked)
    from flax import nnx

    pure = nnx.to_pure_dict(state)
    k = np.asarray(pure["blocks"]["attn2"]["k"]["kernel"])
    np.testing.assert_allclose(k[1], ref["blocks.1.attn2.to_k.weight"].T, rtol=1e-5, atol=1e-6)
    if layout == "lycoris":
        b = np.asarray(pure["blocks"]["ffn"]["up"]["bias"])
        np.testing.assert_allclose(b[0], ref["blocks.0.ffn.net.0.proj.bias"], rtol=1e-5, atol=1e-6)


def test_several_loras_add(wan_folder, tmp_path):
    a = _save(make_lora("peft", seed=3), tmp_path / "a.safetensors")
    b = _save(make_lora("kohya", seed=4), tmp_path / "b.safetensors")
    base, _ = _vidax_dit(wan_folder, [])
    ma, _ = _vidax_dit(wan_folder, [f"{a}:0.5"])
    mb, _ = _vidax_dit(wan_folder, [f"{b}:1.5"])
    both, _ = _vidax_dit(wan_folder, [f"{a}:0.5", f"{b}:1.5"])
    k = "blocks.1.ffn.net.2.weight"
    np.testing.assert_allclose(both[k], base[k] + (ma[k] - base[k]) + (mb[k] - base[k]), rtol=1e-5, atol=1e-6)
