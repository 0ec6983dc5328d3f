"""LoRA adapters on every family diffusers has a LoRA loader for: the DiT a family pipeline loads
with ``--lora L:S`` equals the DiT it loads from the folder whose transformer diffusers fused
(``lora_state_dict`` + ``load_lora_adapter`` + ``fuse_lora(lora_scale=S)`` + ``save_pretrained``),
tensor by tensor. Wan (all variants, end to end through the stages) is in ``test_lora.py``."""
import json

import numpy as np
import pytest
import torch

from tests.refutil import perturb


def _case(family):
    """(model id, diffusers pipeline class, transformer class, config, model_index class name)."""
    import diffusers as d

    if family == "cogvideox":
        from tests.test_cogvideox_pipeline import BASE
        return "cogvideox-2b", d.CogVideoXPipeline, d.CogVideoXTransformer3DModel, BASE, "CogVideoXPipeline"
    if family == "cosmos":
        from tests.cosmos_fixtures import DIT
        return ("cosmos2.5-2b", d.Cosmos2_5_PredictBasePipeline, d.CosmosTransformer3DModel, DIT,
                "Cosmos2_5_PredictBasePipeline")
    if family == "ltx":
        from tests.test_ltx_pipeline import DIT
        return "ltx-video-0.9", d.LTXPipeline, d.LTXVideoTransformer3DModel, DIT, "LTXPipeline"
    if family == "ltx2":
        from tests.test_ltx2_pipeline import DIT
        return "ltx2-t2v", d.LTX2Pipeline, d.LTX2VideoTransformer3DModel, DIT, "LTX2Pipeline"
    if family == "hunyuanvideo":
        from tests.test_hunyuanvideo_pipeline import DIT
        return "hunyuanvideo-t2v", d.HunyuanVideoPipeline, d.HunyuanVideoTransformer3DModel, DIT, "HunyuanVideoPipeline"
    raise ValueError(family)


def _linears(model, limit=None):
    """Every nn.Linear inside the repeated blocks: (name, out, in)."""
    out = [(n, m.out_features, m.in_features) for n, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and "blocks." in n]
    return out[:limit] if limit else out


def _peft_lora(model, seed, rank=4, prefix="transformer.", rename=lambda n: n, A="lora_A", B="lora_B"):
    rng = np.random.default_rng(seed)
    sd = {}
    for n, o, i in _linears(model):
        sd[f"{prefix}{rename(n)}.{A}.weight"] = (0.3 * rng.standard_normal((rank, i))).astype(np.float32)
        sd[f"{prefix}{rename(n)}.{B}.weight"] = (0.3 * rng.standard_normal((o, rank))).astype(np.float32)
    return sd


def _fuse(pipeline_cls, transformer_cls, folder, lora_path, scale, dst):
    tr = transformer_cls.from_pretrained(folder / "transformer")
    sd = pipeline_cls.lora_state_dict(str(lora_path))
    sd = sd[0] if isinstance(sd, tuple) else sd
    tr.load_lora_adapter(sd, prefix="transformer", adapter_name="x")
    tr.fuse_lora(lora_scale=scale)
    tr.unload_lora()
    tr.save_pretrained(dst)


def _host_dit(pipe):
    """The pipeline's DiT as host numpy leaves (whichever of the family's loaders it has)."""
    import jax

    state, _ = pipe._load_dit_host() if hasattr(pipe, "_load_dit_host") else pipe.load_dit()
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def _build(model, folder):
    from vidax import registry

    return registry.get(model).build(None, str(folder), False)


FAMILIES = ["cogvideox", "cosmos", "ltx", "ltx2", "hunyuanvideo"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_lora_matches_diffusers_fuse(family, tmp_path):
    from safetensors.numpy import save_file

    from vidax.weights.lora import check, parse_specs

    model, pcls, tcls, cfg, index_class = _case(family)
    torch.manual_seed(0)
    tr = perturb(tcls(**cfg), seed=1)
    folder = tmp_path / "base"
    tr.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": index_class}))
    lora = tmp_path / "lora.safetensors"
    save_file(_peft_lora(tr, seed=2), str(lora))
    fused = tmp_path / "fused"
    _fuse(pcls, tcls, folder, lora, 0.7, fused / "transformer")
    (fused / "model_index.json").write_text(json.dumps({"_class_name": index_class}))

    pipe = _build(model, folder)
    targets = pipe.lora_targets()
    assert list(targets)[0] == "dit" and len(targets) == (2 if family == "ltx2" else 1)  # + LTX-2's connectors
    pipe.loras = tuple(parse_specs([f"{lora}:0.7"]))
    check(pipe.loras, targets)
    ours, ref, plain = _host_dit(pipe), _host_dit(_build(model, fused)), _host_dit(_build(model, folder))
    assert len(ours) == len(ref)
    moved = sum(not np.array_equal(a, b) for a, b in zip(plain, ref))
    assert moved >= len(_linears(tr)) // 2, f"the LoRA changed only {moved} tensors: a weak test"
    worst = max(float(np.max(np.abs(a.astype(np.float64) - b)) / max(1e-12, float(np.max(np.abs(b)))))
                for a, b in zip(ours, ref) if a.size)
    assert worst <= 1e-5, f"{family}: max relative error {worst:.2e} against diffusers' fused DiT"


@pytest.mark.parametrize("family", ["ltx", "ltx2"])
def test_ltx_comfyui_layout(family, tmp_path):
    """LTX-Video / LTX-2 LoRAs as ComfyUI and LTX-Video-Trainer write them (``diffusion_model.``,
    the original release's names, ``lora_down`` / ``lora_up`` + ``alpha``)."""
    from safetensors.numpy import save_file

    from vidax.models.ltx import dit as ldit
    from vidax.models.ltx import dit2 as ldit2
    from vidax.models.ltx import lora as llora
    from vidax.weights import open_checkpoint
    from vidax.weights import lora as vlora

    model, pcls, tcls, cfg, index_class = _case(family)
    torch.manual_seed(0)
    tr = perturb(tcls(**cfg), seed=3)
    folder = tmp_path / "base"
    tr.save_pretrained(folder / "transformer")
    ren = (lambda n: n.replace("norm_q", "q_norm").replace("norm_k", "k_norm"))
    sd = _peft_lora(tr, seed=4, prefix="diffusion_model.", rename=ren, A="lora_A", B="lora_B")
    lora = tmp_path / "comfy.safetensors"
    save_file(sd, str(lora))
    _fuse(pcls, tcls, folder, lora, 1.1, tmp_path / "fused")
    ref = {k: v.read() for k, v in open_checkpoint(tmp_path / "fused").items()}
    path = folder / "transformer"
    vcfg = (ldit.LTXDiTConfig if family == "ltx" else ldit2.LTX2DiTConfig).from_diffusers(
        json.loads((path / "config.json").read_text()))
    table = llora.aliases(vcfg) if family == "ltx" else llora.aliases2(vcfg)
    with vlora.merging(vlora.Target("dit", path, table, "LTX DiT"), vlora.parse_specs(f"{lora}:1.1")):
        ours = {k: v.read() for k, v in open_checkpoint(path).items()}
    worst = max(float(np.max(np.abs(ours[k] - ref[k])) / max(1e-12, float(np.max(np.abs(ref[k]))))) for k in ref)
    assert worst <= 1e-5, worst
    # the original release's top-level names resolve too (patchify_proj -> proj_in)
    t = vlora.Target("dit", path, table, "LTX DiT")
    save_file({"diffusion_model.patchify_proj.lora_down.weight": np.ones((2, cfg["in_channels"]), np.float32),
               "diffusion_model.patchify_proj.lora_up.weight": np.ones((tr.config.num_attention_heads
                                                                        * tr.config.attention_head_dim, 2), np.float32)},
              str(tmp_path / "top.safetensors"))
    plan = vlora.plan(vlora.parse_specs(str(tmp_path / "top.safetensors")), t)
    assert list(plan) == ["proj_in.weight"]


def test_hunyuanvideo_original_layout_on_fused_modules(tmp_path):
    """Original-release HunyuanVideo LoRAs adapt fused projections (``img_attn_qkv``,
    ``single_blocks.N.linear1`` = q/k/v + MLP) and the (shift, scale)-ordered final modulation: the
    merge equals merging in the original layout and then splitting as the checkpoint loader does;
    the double-block part also equals diffusers' conversion + fuse."""
    from safetensors.numpy import save_file

    from vidax.models.hunyuanvideo import convert as hconv
    from vidax.models.hunyuanvideo import dit as hdit
    from vidax.models.hunyuanvideo import lora as hlora
    from vidax.weights import lora as vlora
    from vidax.weights import open_checkpoint

    model, pcls, tcls, cfg, _ = _case("hunyuanvideo")
    torch.manual_seed(0)
    tr = perturb(tcls(**cfg), seed=5)
    path = tmp_path / "base" / "transformer"
    tr.save_pretrained(path)
    sd = {k: v.detach().numpy() for k, v in tr.state_dict().items()}
    hcfg = hdit.HunyuanVideoConfig.from_diffusers(dict(tr.config))
    from tests.hunyuan_original import hunyuanvideo_original_names

    orig = hunyuanvideo_original_names(hcfg, sd)
    rng = np.random.default_rng(6)
    lora, merged_orig, rank, alpha, scale = {}, dict(orig), 4, 2.0, 0.9
    for name, w in orig.items():
        if w.ndim != 2 or not name.startswith(("double_blocks.", "single_blocks.", "txt_in.individual",
                                               "final_layer.adaLN")):
            continue
        mod = name.removesuffix(".weight")
        down = (0.3 * rng.standard_normal((rank, w.shape[1]))).astype(np.float32)
        up = (0.3 * rng.standard_normal((w.shape[0], rank))).astype(np.float32)
        lora.update({f"diffusion_model.{mod}.lora_down.weight": down, f"diffusion_model.{mod}.lora_up.weight": up,
                     f"diffusion_model.{mod}.alpha": np.asarray(alpha, np.float32)})
        merged_orig[name] = w + scale * alpha / rank * (up @ down)
    assert any("linear1" in k for k in lora) and any("img_attn_qkv" in k for k in lora)
    save_file(lora, str(tmp_path / "orig.safetensors"))
    expected = {k: np.asarray(v) for k, v in hconv.original_to_diffusers(merged_orig, hcfg).items()}
    target = vlora.Target("dit", path, hlora.table, "HunyuanVideo DiT")
    with vlora.merging(target, vlora.parse_specs(f"{tmp_path / 'orig.safetensors'}:{scale}")):
        ours = {k: v.read() for k, v in open_checkpoint(path).items()}
    assert set(ours) == set(expected)
    worst = max(float(np.max(np.abs(ours[k] - expected[k])) / max(1e-12, float(np.max(np.abs(expected[k])))))
                for k in expected)
    assert worst <= 1e-5, worst
    assert not np.allclose(ours["single_transformer_blocks.1.proj_mlp.weight"], sd["single_transformer_blocks.1.proj_mlp.weight"])
    # musubi-tuner / kohya write the same modules flattened: lora_unet_double_blocks_0_img_attn_qkv
    flat = {"lora_unet_" + k.removeprefix("diffusion_model.").rsplit(".", 1 if k.endswith(".alpha") else 2)[0]
            .replace(".", "_") + k[len(k.rsplit(".", 1 if k.endswith(".alpha") else 2)[0]):]: v for k, v in lora.items()}
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in flat
    save_file(flat, str(tmp_path / "flat.safetensors"))
    with vlora.merging(target, vlora.parse_specs(f"{tmp_path / 'flat.safetensors'}:{scale}")):
        ours_flat = {k: v.read() for k, v in open_checkpoint(path).items()}
    assert all(np.array_equal(ours_flat[k], ours[k]) for k in ours)
    assert not np.allclose(ours["norm_out.linear.weight"], sd["norm_out.linear.weight"])

    # diffusers' own conversion (double blocks; its single-block split assumes the 13B width)
    dbl = {}
    for k, v in lora.items():
        if k.startswith("diffusion_model.double_blocks.") and not k.endswith(".alpha"):
            dbl[k.replace(".lora_down.", ".lora_A.").replace(".lora_up.", ".lora_B.")] = v
    save_file(dbl, str(tmp_path / "dbl.safetensors"))
    _fuse(pcls, tcls, tmp_path / "base", tmp_path / "dbl.safetensors", scale, tmp_path / "fused")
    ref = {k: v.read() for k, v in open_checkpoint(tmp_path / "fused").items()}
    with vlora.merging(target, vlora.parse_specs(f"{tmp_path / 'dbl.safetensors'}:{scale}")):
        ours = {k: v.read() for k, v in open_checkpoint(path).items()}
    worst = max(float(np.max(np.abs(ours[k] - ref[k])) / max(1e-12, float(np.max(np.abs(ref[k]))))) for k in ref)
    assert worst <= 1e-5, worst


def test_ltx2_lora_with_connector_keys(tmp_path):
    """An LTX-2 LoRA that also adapts the text connectors (``text_embedding_projection.`` in the
    ComfyUI layout): the connectors take those keys (as diffusers' loader splits them), the DiT the
    rest; both equal diffusers' fused modules, and such a LoRA enters the encode stage's key."""
    import jax
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from safetensors.numpy import save_file

    from stages import run as R
    from stages.request import Request
    from tests.test_ltx2_pipeline import CONN, DIT
    from vidax.weights.lora import parse_specs

    torch.manual_seed(0)
    tr, conn = perturb(LTX2VideoTransformer3DModel(**DIT), seed=7), perturb(LTX2TextConnectors(**CONN), seed=8)
    base = tmp_path / "base"
    tr.save_pretrained(base / "transformer")
    conn.save_pretrained(base / "connectors")
    (base / "model_index.json").write_text(json.dumps({"_class_name": "LTX2Pipeline"}))
    sd = _peft_lora(tr, seed=9, prefix="diffusion_model.", rename=lambda n: n.replace("norm_q", "q_norm"))
    rng = np.random.default_rng(10)
    n_conn = 0
    for n, m in conn.named_modules():
        if isinstance(m, torch.nn.Linear):
            name = n.replace("text_proj_in", "aggregate_embed")
            pre = f"text_embedding_projection.{name}"
            sd[f"{pre}.lora_A.weight"] = (0.3 * rng.standard_normal((4, m.in_features))).astype(np.float32)
            sd[f"{pre}.lora_B.weight"] = (0.3 * rng.standard_normal((m.out_features, 4))).astype(np.float32)
            n_conn += 1
    assert n_conn >= 3
    lora = tmp_path / "av.safetensors"
    save_file(sd, str(lora))
    dit_only = tmp_path / "dit.safetensors"
    save_file({k: v for k, v in sd.items() if k.startswith("diffusion_model.")}, str(dit_only))

    pipe = LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=None, tokenizer=None, connectors=conn,
                        transformer=tr, vocoder=None)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(components=["transformer", "connectors"], lora_scale=0.8)
    pipe.unload_lora_weights()
    fused = tmp_path / "fused"
    tr.save_pretrained(fused / "transformer")
    conn.save_pretrained(fused / "connectors")
    (fused / "model_index.json").write_text(json.dumps({"_class_name": "LTX2Pipeline"}))

    ours = _build("ltx2-t2v", base)
    assert sorted(ours.lora_targets()) == ["connectors", "dit"]
    ours.loras = tuple(parse_specs(f"{lora}:0.8"))
    ref = _build("ltx2-t2v", fused)
    for get in (lambda p: p.load_dit()[0], lambda p: p.load_connectors().state):
        a = [np.asarray(x) for x in jax.tree.leaves(get(ours))]
        b = [np.asarray(x) for x in jax.tree.leaves(get(ref))]
        assert len(a) == len(b) > 4
        worst = max(float(np.max(np.abs(x - y)) / max(1e-12, float(np.max(np.abs(y))))) for x, y in zip(a, b) if y.size)
        assert worst <= 1e-5, worst

    def keys(spec):  # what enters each stage's key for its weights (the folder has no VAE for the rest)
        req = Request(model="ltx2-t2v", checkpoint=str(base), prompt="x", lora=spec)
        pipe = R.make_pipeline(req)
        return {k: R._fingerprints(pipe, k, req) for k in ("encode", "sample")}

    plain, av, dit = keys(None), keys(f"{lora}:0.8"), keys(f"{dit_only}:0.8")
    assert av["encode"] != plain["encode"] and av["sample"] != plain["sample"]
    assert dit["encode"] == plain["encode"] and dit["sample"] != plain["sample"]
