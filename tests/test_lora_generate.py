"""LoRAs on every family with a diffusers LoRA loader other than Wan (``tests/test_lora.py``):
CogVideoX, LTX-Video, LTX-2, HunyuanVideo, Cosmos-Predict2.5.

- end to end: ``vidax generate --checkpoint C --lora L:S`` on a complete tiny diffusers folder
  (``tests/lora_folders.py``) gives the sampled latents of the same request on the folder whose
  transformer diffusers fused (``pipe.load_lora_weights`` + ``fuse_lora(lora_scale=S)`` +
  ``save_pretrained``), within 1e-5 relative; the stage keys follow the LoRA and its scale.
- every layout (diffusers / PEFT, AI-Toolkit, ComfyUI / kohya with ``alpha``, musubi-tuner
  ``lora_unet_``, LyCORIS ``diff_b``), each on every linear layer of the DiT's blocks under the
  names that layout uses (the original release's where the family has them: HunyuanVideo's fused
  ``img_attn_qkv`` / ``linear1``, Cosmos' ``net.blocks``): the merged DiT tensors equal the
  diffusers-fused ones. Where the family's diffusers loader reads the file itself (PEFT everywhere,
  the ``diffusion_model.`` lora_A/lora_B layout for LTX-Video and LTX-2) diffusers fuses that very
  file; where it reads no such layout (it refuses ``.alpha`` keys outside Wan, knows ``lora_unet_``
  and ``diff_b`` only for Wan, splits HunyuanVideo's ``linear1`` only at the 13B width) it fuses
  the same update written in its PEFT layout (alpha / rank folded into lora_B, fused modules split
  by rows) and the LyCORIS full deltas (``diff`` / ``diff_b``) are added to its fused tensors."""
import inspect
import shutil

import numpy as np
import pytest
import torch

from tests import lora_folders, sweep

FAMILIES = ["cogvideox", "ltx", "ltx2", "hunyuanvideo", "cosmos"]
LAYOUTS = ["peft", "aitoolkit", "kohya", "musubi", "lycoris"]
#: (family, layout) files diffusers' own loader for that family reads
DIFFUSERS_READS = {(f, "peft") for f in FAMILIES} | {("ltx", "aitoolkit"), ("ltx2", "aitoolkit")}
#: the layout of each family's end-to-end run (one diffusers reads; non-PEFT where it reads one)
E2E_LAYOUT = {"cogvideox": "peft", "ltx": "aitoolkit", "ltx2": "aitoolkit", "hunyuanvideo": "peft", "cosmos": "peft"}
RANK, ALPHA = 4, 2.0


def _classes(family):
    import diffusers as d

    return {"cogvideox": (d.CogVideoXPipeline, d.CogVideoXTransformer3DModel),
            "ltx": (d.LTXPipeline, d.LTXVideoTransformer3DModel),
            "ltx2": (d.LTX2Pipeline, d.LTX2VideoTransformer3DModel),
            "hunyuanvideo": (d.HunyuanVideoPipeline, d.HunyuanVideoTransformer3DModel),
            "cosmos": (d.Cosmos2_5_PredictBasePipeline, d.CosmosTransformer3DModel)}[family]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (complete tiny folder, the generate arguments of its request), built on first use."""
    built = {}

    def get(family):
        if family not in built:
            root = tmp_path_factory.mktemp(f"{family}_full")
            built[family] = (root, lora_folders.BUILDERS[family](root))
        return built[family]

    return get


# ------------------------------------------------------------------ LoRA files in each layout
def _vidax(family, folder):
    from vidax import registry

    return registry.get(lora_folders.MODELS[family]).build(None, str(folder), False)


def _dit_modules(family, folder):
    """``({module as the layout names it: [(diffusers weight, src0, src1, dst0, dst1)]}, {diffusers
    weight: (out, in)})``: every linear layer of the DiT's blocks, under the original release's
    names where the family's alias table has them (a fused module adapts row ranges of several
    diffusers tensors), else under the diffusers name."""
    from vidax.weights import open_checkpoint

    pcls, tcls = _classes(family)
    tr = tcls.from_pretrained(folder / "transformer")
    linears = {f"{n}.weight": (m.out_features, m.in_features) for n, m in tr.named_modules()
               if isinstance(m, torch.nn.Linear) and "blocks." in n}
    target = _vidax(family, folder).lora_targets()["dit"]
    shapes = {n: tuple(t.shape) for n, t in open_checkpoint(target.path).items()}
    orig = {}
    for alias, v in target.aliases(shapes).items():
        if not alias.endswith(".weight") or alias in shapes:
            continue
        parts = [(v, 0, shapes[v][0], 0, shapes[v][0])] if isinstance(v, str) else list(v)
        if all(p[0] in linears for p in parts):
            orig[alias.removesuffix(".weight")] = parts
    covered = [p[0] for ps in orig.values() for p in ps]
    assert len(covered) == len(set(covered)), "a tensor under two original names"
    for n, (o, _) in linears.items():
        if n not in covered:
            orig[n.removesuffix(".weight")] = [(n, 0, o, 0, o)]
    return orig, linears


def make_lora(family, folder, layout, seed):
    """(the LoRA in ``layout``, the same low-rank update in diffusers' PEFT layout, {diffusers tensor:
    its LyCORIS full delta (``diff`` / ``diff_b``)})."""
    rng = np.random.default_rng(seed)
    mods, linears = _dit_modules(family, folder)
    sd, peft, extra = {}, {}, {}
    has_bias = _biases(family, folder)
    for mod, parts in mods.items():
        out, inp = max(p[2] for p in parts), linears[parts[0][0]][1]
        down = (0.3 * rng.standard_normal((RANK, inp))).astype(np.float32)
        up = (0.3 * rng.standard_normal((out, RANK))).astype(np.float32)
        dn = parts[0][0].removesuffix(".weight") if len(parts) == 1 else None  # the diffusers module (unfused)
        if layout == "peft":
            pass  # the diffusers names: below
        elif layout == "aitoolkit":
            sd[f"diffusion_model.{mod}.lora_A.weight"], sd[f"diffusion_model.{mod}.lora_B.weight"] = down, up
        elif layout in ("kohya", "lycoris"):
            sd[f"diffusion_model.{mod}.lora_down.weight"], sd[f"diffusion_model.{mod}.lora_up.weight"] = down, up
            sd[f"diffusion_model.{mod}.alpha"] = np.asarray(ALPHA, np.float32)
        elif layout == "musubi":
            flat = "lora_unet_" + mod.replace(".", "_")
            sd[f"{flat}.lora_down.weight"], sd[f"{flat}.lora_up.weight"] = down, up
            sd[f"{flat}.alpha"] = np.asarray(ALPHA, np.float32)
        factor = ALPHA / RANK if layout in ("kohya", "lycoris", "musubi") else 1.0
        for name in {p[0] for p in parts}:  # the same update on diffusers' separate tensors
            b = np.zeros((linears[name][0], RANK), np.float32)
            for n, s0, s1, d0, d1 in parts:
                if n == name:
                    b[d0:d1] = factor * up[s0:s1]
            m = name.removesuffix(".weight")
            peft[f"transformer.{m}.lora_A.weight"], peft[f"transformer.{m}.lora_B.weight"] = down, b
        if layout == "lycoris" and dn is not None:  # full deltas: every bias, the weights of a few modules
            if f"{dn}.bias" in has_bias:
                d = (0.2 * rng.standard_normal(linears[parts[0][0]][0])).astype(np.float32)
                sd[f"diffusion_model.{mod}.diff_b"], extra[f"{dn}.bias"] = d, d
            if len(extra) < 6:
                d = (0.05 * rng.standard_normal(linears[parts[0][0]])).astype(np.float32)
                sd[f"diffusion_model.{mod}.diff"], extra[f"{dn}.weight"] = d, d
    if layout == "peft":
        sd = dict(peft)
    if layout == "lycoris":
        assert len(extra) >= 4 and any(k.endswith(".weight") for k in extra), "too few full deltas for a test"
    return sd, peft, extra


def _biases(family, folder):
    from vidax.weights import open_checkpoint

    return {n for n in open_checkpoint(folder / "transformer") if n.endswith(".bias")}


def _save(sd, path):
    from safetensors.numpy import save_file

    save_file(sd, str(path))
    return path


def fuse(family, folder, lora_path, scale, extra=None, dst=None):
    """diffusers: the family pipeline's ``load_lora_weights`` + ``fuse_lora(lora_scale)`` +
    ``unload_lora_weights`` on the folder's transformer (``extra``: full deltas added after, times
    the scale); the fused state dict, and with ``dst`` a copy of ``folder`` whose transformer it is."""
    pcls, tcls = _classes(family)
    tr = tcls.from_pretrained(folder / "transformer")
    params = [p for p in inspect.signature(pcls.__init__).parameters if p not in ("self", "transformer")]
    kw = {p: None for p in params if inspect.signature(pcls.__init__).parameters[p].default is inspect.Parameter.empty}
    if family == "cosmos":
        from tests.cosmos_fixtures import DummySafety

        from diffusers import AutoencoderKLWan

        kw["safety_checker"], kw["vae"] = DummySafety(), AutoencoderKLWan.from_pretrained(folder / "vae")
    pipe = pcls(transformer=tr, **kw)
    pipe.load_lora_weights(str(lora_path))
    pipe.fuse_lora(components=["transformer"], lora_scale=scale)
    pipe.unload_lora_weights()
    with torch.no_grad():
        sd = tr.state_dict()
        for k, d in (extra or {}).items():
            sd[k].add_(scale * torch.from_numpy(d))
    if dst is not None:
        shutil.copytree(folder, dst)
        shutil.rmtree(dst / "transformer")
        tr.save_pretrained(dst / "transformer")
    return {k: v.detach().numpy().copy() for k, v in tr.state_dict().items()}


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(1e-12, float(np.max(np.abs(b)))))


# ------------------------------------------------------------------ every layout, the merged DiT
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_layout_merges_as_diffusers_fuses(folders, tmp_path, family, layout):
    from vidax.weights import lora as vlora
    from vidax.weights import open_checkpoint

    folder, _ = folders(family)
    sd, peft, extra = make_lora(family, folder, layout, seed=FAMILIES.index(family) * 10 + LAYOUTS.index(layout))
    lora = _save(sd, tmp_path / f"{layout}.safetensors")
    reads = (family, layout) in DIFFUSERS_READS
    ref = fuse(family, folder, lora if reads else _save(peft, tmp_path / "peft.safetensors"), 0.7, extra)
    base = {k: v.read() for k, v in open_checkpoint(folder / "transformer").items()}
    pipe = _vidax(family, folder)
    targets = pipe.lora_targets()
    specs = vlora.parse_specs(f"{lora}:0.7")
    vlora.check(specs, targets)  # what validation runs: every key matched, every shape fits
    with vlora.merging(targets["dit"], specs, list(targets.values())):
        ours = {k: v.read() for k, v in open_checkpoint(folder / "transformer").items()}
    assert set(ours) == set(ref)
    moved = [k for k in ref if not np.allclose(ref[k], base[k], rtol=1e-3, atol=1e-4)]
    n_linear = len(_dit_modules(family, folder)[1])
    n_bias = sum(k.endswith(".bias") for k in extra)
    assert len(moved) >= n_linear + n_bias, f"the LoRA moved only {len(moved)} tensors: a weak test"
    worst = max(_rel(ours[k], ref[k]) for k in ref)
    assert worst <= 1e-5, f"{family} / {layout}: merged DiT differs from diffusers' fused one by {worst:.2e}"


# ------------------------------------------------------------------ end to end through vidax generate
def _argv(store, folder, args, lora=None):
    argv = ["generate", "--checkpoint", str(folder), "--steps", "2", "--decode-stages", "1", "--seed", "3",
            "--run-id", "r", "--store", str(store), *args]
    return argv + (["--lora", lora] if lora else [])


def _latents(store, run_id="r"):
    from stages.store import RunStore, read_array

    group = RunStore(str(store)).run(run_id).group("sample.zarr")
    return {name: read_array(group, name) for name in sorted(group.array_keys())}


def _generate(store, folder, args, lora=None):
    from stages import cli

    assert cli.main(_argv(store, folder, args, lora)) == 0
    return _latents(store)


def _request(folder, args, lora=None):
    """The validated request ``vidax generate`` builds from these arguments."""
    from stages import cli
    from stages.request import validate

    argv = _argv("unused", folder, args, lora)
    model = argv[argv.index("--model") + 1]
    return validate(cli._request_from_args(cli.build_parser(model).parse_args(argv)))


def _sampled(store, folder, args):
    """The same request's encode and sample stages alone (``vidax stage``: no decode, cheaper)."""
    from stages import cli
    from stages.store import RunStore

    RunStore(str(store)).run("r").write_json("request.json", _request(folder, args).to_json())
    for stage in ("encode", "sample"):
        assert cli.main(["stage", "r", stage, "--store", str(store)]) == 0
    return _latents(store)


@pytest.mark.parametrize("family", sweep.sample(FAMILIES, 2, "lora-generate"))  # all: make test-all
def test_generate_with_lora_equals_the_diffusers_fused_folder(folders, tmp_path, family):
    from stages import run as R

    folder, args = folders(family)
    layout = E2E_LAYOUT[family]
    assert (family, layout) in DIFFUSERS_READS
    sd, _, _ = make_lora(family, folder, layout, seed=100 + FAMILIES.index(family))
    lora = _save(sd, tmp_path / "style.safetensors")
    fuse(family, folder, lora, 0.8, dst=tmp_path / "fused")
    ours = _generate(tmp_path / "s1", folder, args, f"{lora}:0.8")
    ref = _generate(tmp_path / "s2", tmp_path / "fused", args)
    assert set(ours) == set(ref) and "latents" in ours
    for name in ref:
        err = _rel(ours[name], ref[name])
        print(f"{family}: {name} rel err {err:.2e}")
        assert err <= 1e-5, f"{family}: sampled {name} differ from the fused folder's: {err:.2e} relative"
    plain = _sampled(tmp_path / "s3", folder, args)["latents"]
    assert _rel(plain, ref["latents"]) > 1e-3, "the LoRA does not change the result: a weak test"
    # the sample stage's key follows the LoRA's content and scale; the encode stage's does not move
    keys = [R.stage_keys(req, R.make_pipeline(req)) for req in
            (_request(folder, args, s) for s in (None, f"{lora}:0.8", f"{lora}:0.5"))]
    assert len({k["sample"] for k in keys}) == 3
    assert len({k["encode"] for k in keys}) == 1


# ------------------------------------------------------------------ bad LoRAs on every family
def _bad_loras(family, folder, d):
    """(file, texts its refusal names): a module this DiT does not have, a shape that does not fit,
    and a Wan LoRA (another family's names)."""
    sd, _, _ = make_lora(family, folder, "kohya", seed=7)
    down = next(k for k in sorted(sd) if k.endswith(".lora_down.weight"))
    mod = down.removesuffix(".lora_down.weight")
    unknown = dict(sd)
    for role in ("lora_down.weight", "lora_up.weight", "alpha"):
        unknown[f"diffusion_model.blocks_of_another_model.9.{role}"] = sd[f"{mod}.{role}"]
    shape = dict(sd)
    shape[f"{mod}.lora_up.weight"] = np.ones((sd[f"{mod}.lora_up.weight"].shape[0] + 3, RANK), np.float32)
    from tests.test_lora import make_lora as wan_lora

    return [(_save(unknown, d / "unknown.safetensors"), ["match no module", "blocks_of_another_model.9"]),
            (_save(shape, d / "shape.safetensors"), ["shape mismatch", mod.removeprefix("diffusion_model.")]),
            (_save(wan_lora("kohya"), d / "wan.safetensors"), ["match no module", "diffusion_model.blocks.0"])]


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_loras_refused_at_validation(folders, tmp_path, capsys, family):
    """Each family: exit 2 before anything is written, one line naming the file and the keys."""
    from stages import cli
    from tests.test_bad_inputs import tree_digest

    folder, args = folders(family)
    store = tmp_path / "store"
    (store / "runs" / "earlier").mkdir(parents=True)
    (store / "runs" / "earlier" / "request.json").write_text('{"prompt": "an earlier run"}')
    cases = _bad_loras(family, folder, tmp_path)
    capsys.readouterr()  # (the folder's build)
    for path, texts in cases:
        before = tree_digest(store)
        rc = cli.main(_argv(store, folder, args, f"{path}:0.5"))
        out, err = capsys.readouterr()
        err = err.strip()
        assert rc == 2, (out, err)
        assert err.count("\n") == 0 and err.startswith("vidax: error: lora:") and "Traceback" not in err, err
        for t in [str(path), *texts]:
            assert t in err, err
        assert tree_digest(store) == before, "the store changed"
