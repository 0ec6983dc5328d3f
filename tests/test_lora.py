"""LoRA adapters: merged at load, against diffusers' ``load_lora_weights`` + ``fuse_lora``.

One tiny complete Wan diffusers folder (UMT5 text encoder, word-level tokenizer, DiT, VAE) is
built once per module; each LoRA layout is checked against the folder whose transformer diffusers
fused, end to end through ``vidax generate`` (PEFT on Wan2.1 T2V; kohya, PEFT and musubi on both
Wan2.2 A14B experts; kohya with the image keys on Wan2.1 I2V) and on the loaded DiT tensors for
every layout. The other families: ``tests/test_lora_generate.py``."""
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

    args = ["generate", "--model", over.pop("model", "wan2.1-t2v-1.3b"), "--checkpoint", str(checkpoint),
            "--prompt", "a red kite",
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


# ------------------------------------------------------------------ (c) keys and bad LoRAs
def _keys(folder, lora=None, model="wan2.1-t2v-1.3b"):
    from stages import run as R
    from stages.request import Request, validate

    req = validate(Request(model=model, checkpoint=str(folder), prompt="a red kite", height=32, width=32,
                           num_frames=5, steps=2, lora=lora))
    return R.stage_keys(req, R.make_pipeline(req))


def test_stage_keys_follow_lora_content_and_scale(wan_folder, tmp_path):
    import fsspec

    a = _save(make_lora("peft", seed=5), tmp_path / "a.safetensors")
    b = _save(make_lora("peft", seed=6), tmp_path / "b.safetensors")
    copy = tmp_path / "elsewhere" / "renamed.safetensors"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    with fsspec.open("memory://loras/a.safetensors", "wb") as f:  # the same bytes behind a URL
        f.write(a.read_bytes())
    none, ka, kb = _keys(wan_folder), _keys(wan_folder, f"{a}:0.5"), _keys(wan_folder, [f"{b}:0.5"])
    assert none["encode"] == ka["encode"] == kb["encode"]  # a DiT LoRA leaves the prompt encode alone
    assert len({none["sample"], ka["sample"], kb["sample"]}) == 3
    assert all(ka[s] != none[s] for s in none if s != "encode")  # everything after sample follows
    assert _keys(wan_folder, f"{a}:0.75")["sample"] != ka["sample"]
    assert _keys(wan_folder, f"{copy}:0.5")["sample"] == ka["sample"]  # content, not path
    assert _keys(wan_folder, "memory://loras/a.safetensors:0.5")["sample"] == ka["sample"]
    assert _keys(wan_folder, [f"{a}:0.5", f"{b}:0.5"])["sample"] not in (ka["sample"], kb["sample"])


@pytest.fixture(scope="module")
def bad_loras(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_loras")
    good = _save(make_lora("peft", seed=7), d / "good.safetensors")
    data = good.read_bytes()
    (d / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    (d / "garbage.safetensors").write_bytes(b"\x00" * 64)
    torch.save({k: torch.from_numpy(v) for k, v in make_lora("peft", seed=7).items()}, d / "pickled.pt")
    shutil.copy(d / "pickled.pt", d / "pickled-renamed.safetensors")
    i2v = make_lora("kohya", seed=8, modules=_modules()[:1])
    i2v["diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight"] = np.ones((RANK, 24), np.float32)
    i2v["diffusion_model.blocks.0.cross_attn.k_img.lora_up.weight"] = np.ones((24, RANK), np.float32)
    _save(i2v, d / "i2v.safetensors")
    _save(make_lora("peft", modules=[("blocks.0.attn1.to_q", "", 40, 40)]), d / "bigger-model.safetensors")
    deep = make_lora("peft", modules=[("blocks.7.attn1.to_q", "", 24, 24)])
    _save(deep, d / "more-layers.safetensors")
    _save({"text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": np.ones((RANK, 32), np.float32),
           "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": np.ones((32, RANK), np.float32)},
          d / "text-encoder.safetensors")
    _save({"transformer.blocks.0.attn1.to_q.lora_A.weight": np.ones((RANK, 24), np.float32)}, d / "half.safetensors")
    _save({"transformer.blocks.0.attn1.to_q.weight": np.ones((24, 24), np.float32)}, d / "a-model.safetensors")
    return d


BAD = [
    ("truncated.safetensors", ["truncated.safetensors", "not a readable safetensors"]),
    ("garbage.safetensors", ["garbage.safetensors", "not a readable safetensors"]),
    ("pickled.pt", ["pickled.pt", "a pickle"]),
    ("pickled-renamed.safetensors", ["pickled-renamed.safetensors", "a pickle"]),
    ("i2v.safetensors", ["i2v.safetensors", "match no module", "blocks.0.cross_attn.k_img.lora_down.weight"]),
    ("bigger-model.safetensors", ["bigger-model.safetensors", "shape mismatch", "blocks.0.attn1.to_q"]),
    ("more-layers.safetensors", ["more-layers.safetensors", "match no module", "blocks.7.attn1.to_q"]),
    ("text-encoder.safetensors", ["match no module", "text_encoder.encoder.block.0"]),
    ("half.safetensors", ["half.safetensors", "incomplete", "blocks.0.attn1.to_q"]),
    ("a-model.safetensors", ["a-model.safetensors", "no LoRA layout", "transformer.blocks.0.attn1.to_q.weight"]),
    ("missing.safetensors", ["missing.safetensors", "no such file"]),
    ("good.safetensors:nan", ["finite"]),
    ("high=good.safetensors:1", ["no DiT 'high'"]),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store folder with content (the LoRA checks fail before the store is opened: what matters is
    that nothing in it changes; the suite's seeded store costs a whole tiny run to build)."""
    d = tmp_path_factory.mktemp("lora_store")
    (d / "runs" / "earlier").mkdir(parents=True)
    (d / "runs" / "earlier" / "request.json").write_text(json.dumps({"prompt": "an earlier run"}))
    (d / "runs" / "earlier" / "manifest.json").write_text(json.dumps({"stages": []}))
    return d


@pytest.mark.parametrize("spec,texts", BAD, ids=[b[0] for b in BAD])
def test_bad_loras_exit_2_naming_file_and_keys(wan_folder, bad_loras, store, capsys, spec, texts):
    from stages import cli
    from tests.test_bad_inputs import tree_digest

    if "=" in spec:
        t, rest = spec.split("=", 1)
        spec = f"{t}={bad_loras / rest}"
    else:
        spec = str(bad_loras / spec)
    before = tree_digest(store)
    rc = cli.main(["generate", "--checkpoint", str(wan_folder), "--prompt", "a red kite", "--height", "32",
                   "--width", "32", "--frames", "5", "--steps", "1", "--lora", spec, "--store", str(store)])
    out, err = capsys.readouterr()
    err = err.strip()
    assert rc == 2, (out, err)
    assert err.count("\n") == 0 and err.startswith("vidax: error: lora:"), err
    for t in texts:
        assert t in err, err
    assert tree_digest(store) == before, "the store changed"


def test_lora_needs_a_checkpoint(store, capsys, bad_loras):
    from stages import cli

    rc = cli.main(["generate", "--prompt", "x", "--frames", "5", "--steps", "1", "--height", "32", "--width", "32",
                   "--lora", str(bad_loras / "good.safetensors"), "--store", str(store)])
    assert rc == 2 and "give --checkpoint" in capsys.readouterr().err


def test_spec_parsing():
    from vidax.weights.lora import LoraError, LoraSpec, parse_spec, parse_specs

    assert parse_spec("a.safetensors") == LoraSpec("a.safetensors", 1.0, None)
    assert parse_spec("high=a.safetensors:0.5") == LoraSpec("a.safetensors", 0.5, "high")
    assert parse_spec("gs://b/x.safetensors") == LoraSpec("gs://b/x.safetensors", 1.0, None)
    assert parse_spec("low=gs://b/x.safetensors:-1") == LoraSpec("gs://b/x.safetensors", -1.0, "low")
    assert str(parse_spec("low=gs://b/x.safetensors:2")) == "low=gs://b/x.safetensors:2"
    assert parse_spec(str(parse_spec("a:0.123456789012"))).scale == 0.123456789012  # the canonical text is exact
    assert parse_specs(None) == [] and len(parse_specs(["a:1", "b:2"])) == 2
    for bad in ("", ":1", "a:inf", 3):
        with pytest.raises(LoraError):
            parse_spec(bad)


# ------------------------------------------------------------------ (d) Wan2.2 A14B experts, Wan2.1 I2V
@pytest.fixture(scope="module")
def a14b_folder(tmp_path_factory):
    """Wan2.2 A14B-shaped: two experts (``transformer`` high noise, ``transformer_2`` low noise)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**VAE)
    t1, t2 = perturb(WanTransformer3DModel(**DIT), seed=11), perturb(WanTransformer3DModel(**DIT), seed=12)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=t1, transformer_2=t2, vae=vae,
                       scheduler=sched, boundary_ratio=0.875)
    folder = tmp_path_factory.mktemp("wan_a14b")
    pipe.save_pretrained(folder)
    return folder


def test_a14b_unnamed_loras_go_to_both_experts_named_ones_to_one(a14b_folder, tmp_path):
    """As diffusers: ``load_lora_weights`` (high-noise expert) + ``load_into_transformer_2=True``
    (low-noise expert); an unnamed --lora adapts both, high= / low= one."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from vidax.models.wan.pipeline import WanT2V
    from vidax.weights.lora import parse_specs

    both = _save(make_lora("kohya", seed=21), tmp_path / "both.safetensors")
    low = _save(make_lora("peft", seed=22), tmp_path / "low.safetensors")
    t1 = WanTransformer3DModel.from_pretrained(a14b_folder / "transformer")
    t2 = WanTransformer3DModel.from_pretrained(a14b_folder / "transformer_2")
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=t1, transformer_2=t2, vae=None, scheduler=None)
    pipe.load_lora_weights(str(both), adapter_name="both")
    pipe.load_lora_weights(str(both), adapter_name="both", load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=0.8)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(low), adapter_name="low", load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer_2"], lora_scale=1.3)
    pipe.unload_lora_weights()
    refs = {1: t1.state_dict(), 2: t2.state_dict()}

    vx = WanT2V(a14b_folder)
    assert sorted(vx.lora_targets()) == ["high", "low"]
    vx.loras = tuple(parse_specs([f"{both}:0.8", f"low={low}:1.3"]))
    for expert in (1, 2):
        state, _ = vx._load_dit_host(expert)
        from flax import nnx

        q = np.asarray(nnx.to_pure_dict(state)["blocks"]["attn1"]["q"]["kernel"])
        for i in range(2):
            ref = refs[expert][f"blocks.{i}.attn1.to_q.weight"].numpy().T
            assert _rel(q[i], ref) <= 1e-5, f"expert {expert} block {i}: {_rel(q[i], ref):.2e}"
    # the keys follow each expert's LoRAs
    base = dict(model="wan2.2-t2v-a14b", checkpoint=str(a14b_folder), prompt="x", height=32, width=32, num_frames=5,
                steps=2)
    from stages import run as R
    from stages.request import Request

    def key(lora):
        req = Request(**base, lora=lora).resolved()
        return R.stage_keys(req, R.make_pipeline(req))["sample"]

    assert len({key(None), key(f"high={low}:1"), key(f"low={low}:1"), key(f"{low}:1")}) == 4


def test_i2v_lora_with_image_keys(tmp_path):
    """A Wan2.1 I2V LoRA (the cross-attention's image k/v, ``k_img`` / ``v_img``) on an I2V DiT."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    cfg = {**DIT, "in_channels": 36, "image_dim": 16, "added_kv_proj_dim": 24}
    tr = perturb(WanTransformer3DModel(**cfg), seed=31)
    tr.save_pretrained(tmp_path / "i2v" / "transformer")
    mods = _modules() + [(f"blocks.{i}.attn2.add_{n}_proj", f"blocks.{i}.cross_attn.{n}_img", 24, 24)
                         for i in range(2) for n in ("k", "v")]
    lora = _save(make_lora("kohya", seed=32, modules=mods), tmp_path / "i2v.safetensors")
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, transformer=tr, vae=None, scheduler=None,
                                   image_encoder=None, image_processor=None)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(lora_scale=0.9)
    pipe.unload_lora_weights()
    ref = {k: v.detach().numpy() for k, v in tr.state_dict().items()}
    merged, _ = _vidax_dit(tmp_path / "i2v", [f"{lora}:0.9"])
    worst = max(_rel(merged[k], ref[k]) for k in ref)
    assert worst <= 1e-5 and _rel(merged["blocks.1.attn2.add_v_proj.weight"], ref["blocks.1.attn2.add_v_proj.weight"]) <= 1e-5


def test_peft_metadata_alpha_as_diffusers_reads_it(wan_folder, tmp_path):
    """A diffusers-saved LoRA carries its LoraConfig (``lora_adapter_metadata``): alpha / r, with
    per-module ``alpha_pattern`` / ``rank_pattern``, scales the update."""
    from peft import LoraConfig
    from safetensors.numpy import save_file

    mods = _modules()
    cfg = LoraConfig(r=RANK, lora_alpha=8, alpha_pattern={"blocks.1.ffn.net.2": 2},
                     target_modules=[m[0] for m in mods]).to_dict()
    cfg = {f"transformer.{k}": (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}  # as a pipeline saves
    path = tmp_path / "meta.safetensors"
    save_file(make_lora("peft", seed=41), str(path), metadata={"lora_adapter_metadata": json.dumps(cfg, default=str)})
    ref = fused_transformer(wan_folder, path, 0.5)
    merged, _ = _vidax_dit(wan_folder, [f"{path}:0.5"])
    base, _ = _vidax_dit(wan_folder, [])
    worst = max(_rel(merged[k], ref[k]) for k in ref)
    assert worst <= 1e-5, f"max relative error {worst:.2e}"
    # the metadata matters: alpha 8 / r 4 doubles the update, the pattern's 2 / 4 halves it
    plain = _save(make_lora("peft", seed=41), tmp_path / "plain.safetensors")
    pm, _ = _vidax_dit(wan_folder, [f"{plain}:0.5"])
    for k, f in (("blocks.0.attn1.to_q.weight", 2.0), ("blocks.1.ffn.net.2.weight", 0.5)):
        np.testing.assert_allclose(merged[k] - base[k], f * (pm[k] - base[k]), rtol=1e-4, atol=1e-6)


def test_compat_load_pretrained_with_lora_matches_fused_forward(wan_folder, tmp_path):
    from diffusers import WanTransformer3DModel

    from tests.refutil import assert_parity
    from vidax.compat import load_pretrained

    lora = _save(make_lora("musubi", seed=51), tmp_path / "m.safetensors")
    fused_transformer(wan_folder, lora, 1.2, dst=tmp_path / "fused")
    ref_model = WanTransformer3DModel.from_pretrained(tmp_path / "fused" / "transformer").eval()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 16, 2, 8, 8)).astype(np.float32)
    ctx = rng.standard_normal((1, 8, 32)).astype(np.float32)
    t = np.asarray([500.0], np.float32)
    with torch.no_grad():
        ref = ref_model(hidden_states=torch.from_numpy(x), timestep=torch.from_numpy(t),
                        encoder_hidden_states=torch.from_numpy(ctx), return_dict=False)[0].numpy()
    ours = load_pretrained(wan_folder / "transformer", lora=f"{lora}:1.2")
    assert_parity(ours.forward(hidden_states=x, timestep=t, encoder_hidden_states=ctx), ref, tol=1e-5,
                  what="DiT forward with a merged LoRA")


def test_prompt_file_lines_take_lora(wan_folder, bad_loras, tmp_path):
    from stages.prompts import parse_prompt_file

    good, trunc = bad_loras / "good.safetensors", bad_loras / "truncated.safetensors"
    common = dict(model="wan2.1-t2v-1.3b", checkpoint=str(wan_folder), height=32, width=32, num_frames=5, steps=1)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({**common, "prompt": "a red kite", **extra}) for extra in (
        {"lora": f"{good}:0.5"}, {"lora": [f"{good}:0.5", str(good)]}, {"lora": f"{trunc}:1"}, {})) + "\n")
    lines = parse_prompt_file(str(f))
    assert lines[0].request.lora == [f"{good}:0.5"]
    assert lines[1].request.lora == [f"{good}:0.5", f"{good}:1"]
    assert lines[2].request is None and "lora:" in lines[2].error and "truncated.safetensors" in lines[2].error
    assert lines[3].request.lora is None


def test_families_without_lora_support_refuse(tmp_path, bad_loras):
    """A family whose pipeline has no LoRA targets says so (never a LoRA silently dropped)."""
    from stages.request import Request, RequestError, _check_loras
    from vidax.pipeline import Pipeline

    class NoLora(Pipeline):
        preset, _folder = None, tmp_path

    req = Request(model="wan2.1-t2v-1.3b", checkpoint=str(tmp_path), prompt="x",
                  lora=str(bad_loras / "good.safetensors"))
    with pytest.raises(RequestError, match="not supported for this model family"):
        _check_loras(req, NoLora(), False)


@pytest.mark.parametrize("scale_kw", [dict(mesh="tp=2"), dict(offload_chunk_size=1)], ids=["tp", "offload"])
def test_merged_weights_are_placed_as_any(wan_folder, tmp_path, scale_kw):
    """Tensor-parallel placement and offloading take the merged weights as they take a checkpoint's:
    the runner holds the diffusers-fused folder's weights."""
    import jax

    from vidax.models.wan.pipeline import WanT2V
    from vidax.weights.lora import parse_specs

    lora = _save(make_lora("kohya", seed=61), tmp_path / "k.safetensors")
    fused_transformer(wan_folder, lora, 0.8, dst=tmp_path / "fused")
    ours = WanT2V(wan_folder, **scale_kw)
    ours.loras = tuple(parse_specs(f"{lora}:0.8"))
    a, _ = ours.load_dit()
    b, _ = WanT2V(tmp_path / "fused", **scale_kw).load_dit()
    def held(r):  # the placed weights (tp), or the rest placed and the blocks' host chunks (offload)
        return jax.tree.leaves((r.rest, r.stacks if r.offload is None else
                                [p.host_chunks for p in r.offload.pools.values()]))

    la, lb = held(a), held(b)
    assert len(la) == len(lb) and len(la) > 10
    worst = max(_rel(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
    assert worst <= 1e-5, worst


def test_relative_lora_paths_are_stored_absolute(wan_folder, bad_loras, monkeypatch):
    from stages.request import Request, validate

    monkeypatch.chdir(bad_loras)
    req = validate(Request(model="wan2.1-t2v-1.3b", checkpoint=str(wan_folder), prompt="a red kite", height=32,
                           width=32, num_frames=5, steps=1, lora="good.safetensors:0.25"))
    assert req.lora == [f"{bad_loras / 'good.safetensors'}:0.25"]


def test_a14b_end_to_end_high_and_low_loras(wan_folder, tmp_path):
    """Wan2.2 A14B through the stages: an unnamed LoRA on both experts, ``high=`` on the first,
    ``low=`` on the second; the latents equal the run on the folder whose two transformers
    diffusers fused the same way (both experts run: one step each side of the boundary)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    base = tmp_path / "a14b"
    shutil.copytree(wan_folder, base)
    torch.manual_seed(1)
    perturb(WanTransformer3DModel(**DIT), seed=71).save_pretrained(base / "transformer_2")
    index = json.loads((base / "model_index.json").read_text())
    index.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.875)
    (base / "model_index.json").write_text(json.dumps(index))
    both = _save(make_lora("kohya", seed=72), tmp_path / "both.safetensors")
    high = _save(make_lora("peft", seed=73), tmp_path / "high.safetensors")
    low = _save(make_lora("musubi", seed=74), tmp_path / "low.safetensors")

    t1 = WanTransformer3DModel.from_pretrained(base / "transformer")
    t2 = WanTransformer3DModel.from_pretrained(base / "transformer_2")
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=t1, transformer_2=t2, vae=None, scheduler=None)
    for path, scale, comps in ((both, 0.6, ("transformer", "transformer_2")), (high, 0.9, ("transformer",)),
                               (low, 1.2, ("transformer_2",))):
        for c in comps:
            pipe.load_lora_weights(str(path), adapter_name=f"{path.stem}_{c}", load_into_transformer_2=c != "transformer")
        pipe.fuse_lora(components=list(comps), lora_scale=scale)
        pipe.unload_lora_weights()
    fused = tmp_path / "fused"
    shutil.copytree(base, fused)
    for c, t in (("transformer", t1), ("transformer_2", t2)):
        shutil.rmtree(fused / c)
        t.save_pretrained(fused / c)

    from vidax.models.wan.pipeline import WanT2V

    vx = WanT2V(base)
    assert [e for e, _, _ in vx.expert_segments(vx.scheduler(2, "unipc", 3.0))] == [1, 2]  # both experts run
    over = {"model": "wan2.2-t2v-a14b"}
    ours = _generate(tmp_path / "s1", base, [f"{both}:0.6", f"high={high}:0.9", f"low={low}:1.2"], **over)
    ref = _generate(tmp_path / "s2", fused, **over)
    assert _rel(ours, ref) <= 1e-5, f"latents differ: {_rel(ours, ref):.2e}"
    swapped = _generate(tmp_path / "s3", base, [f"{both}:0.6", f"low={high}:0.9", f"high={low}:1.2"], **over)
    assert _rel(swapped, ref) > 1e-4  # the experts' LoRAs are not interchangeable


def test_full_diffs_on_norms_head_and_conv(wan_folder, tmp_path):
    """LyCORIS full deltas as the distillation LoRAs carry them (``head.head.diff``, norm ``.diff``,
    a conv ``.diff``, ``.diff_b``): ``W + scale * diff`` on the tensor the original name maps to."""
    rng = np.random.default_rng(81)
    base, _ = _vidax_dit(wan_folder, [])
    diffs = {"head.head": "proj_out", "blocks.1.norm3": "blocks.1.norm2", "patch_embedding": "patch_embedding",
             "blocks.0.self_attn.norm_q": "blocks.0.attn1.norm_q"}
    sd, want = {}, {}
    for orig, dif in diffs.items():
        w = base[f"{dif}.weight"]
        sd[f"diffusion_model.{orig}.diff"] = rng.standard_normal(w.shape).astype(np.float32)
        want[f"{dif}.weight"] = w + 0.5 * sd[f"diffusion_model.{orig}.diff"]
        if f"{dif}.bias" in base:
            sd[f"diffusion_model.{orig}.diff_b"] = rng.standard_normal(base[f"{dif}.bias"].shape).astype(np.float32)
            want[f"{dif}.bias"] = base[f"{dif}.bias"] + 0.5 * sd[f"diffusion_model.{orig}.diff_b"]
    path = _save(sd, tmp_path / "diffs.safetensors")
    merged, _ = _vidax_dit(wan_folder, [f"{path}:0.5"])
    assert len(want) >= 6
    for k in merged:
        np.testing.assert_allclose(merged[k], want.get(k, base[k]), rtol=1e-6, atol=1e-6, err_msg=k)


def test_i2v_end_to_end_with_image_keys(wan_folder, tmp_path, cond_image):
    """Wan2.1 I2V through the stages: a LoRA with the image cross-attention's keys (``k_img`` /
    ``v_img``, kohya layout) gives the latents of the folder whose transformer diffusers'
    ``WanImageToVideoPipeline`` fused."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    from tests.test_wan_i2v import CLIP

    base = tmp_path / "i2v"
    shutil.copytree(wan_folder, base)
    shutil.rmtree(base / "transformer")
    torch.manual_seed(2)
    perturb(WanTransformer3DModel(**{**DIT, "in_channels": 36, "image_dim": CLIP["hidden_size"],
                                     "added_kv_proj_dim": 24}), seed=91).save_pretrained(base / "transformer")
    perturb(CLIPVisionModel(CLIPVisionConfig(**CLIP)), seed=92).save_pretrained(base / "image_encoder")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        base / "image_processor")
    index = json.loads((base / "model_index.json").read_text())
    index.update(_class_name="WanImageToVideoPipeline", image_encoder=["transformers", "CLIPVisionModel"],
                 image_processor=["transformers", "CLIPImageProcessor"])
    (base / "model_index.json").write_text(json.dumps(index))
    mods = _modules() + [(f"blocks.{i}.attn2.add_{n}_proj", f"blocks.{i}.cross_attn.{n}_img", 24, 24)
                         for i in range(2) for n in ("k", "v")]
    lora = _save(make_lora("kohya", seed=93, modules=mods), tmp_path / "i2v.safetensors")
    tr = WanTransformer3DModel.from_pretrained(base / "transformer")
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, transformer=tr, vae=None, scheduler=None,
                                   image_encoder=None, image_processor=None)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(lora_scale=0.9)
    pipe.unload_lora_weights()
    fused = tmp_path / "fused"
    shutil.copytree(base, fused)
    shutil.rmtree(fused / "transformer")
    tr.save_pretrained(fused / "transformer")
    over = {"model": "wan2.1-i2v-480p", "image": cond_image}
    ours = _generate(tmp_path / "s1", base, [f"{lora}:0.9"], **over)
    ref = _generate(tmp_path / "s2", fused, **over)
    err = _rel(ours, ref)
    print(f"I2V latents rel err {err:.2e}")
    assert err <= 1e-5, f"latents differ from the fused folder's: {err:.2e} relative"
    no_img = _save({k: v for k, v in make_lora("kohya", seed=93, modules=mods).items() if "_img" not in k},
                   tmp_path / "no-img.safetensors")
    assert _rel(_generate(tmp_path / "s3", base, [f"{no_img}:0.9"], **over), ref) > 1e-4  # the image keys took part
