"""Sequence parallelism past the head count: USP attention (Ulysses x ring) on 8 fake CPU devices.

- the core unit (``vidax.core.sharding.usp_attention``) against dense attention: joint tokens,
  padded tokens, every Ulysses x ring split of 8 devices;
- every family's tiny 2-head DiT through ``load_pretrained(..., mesh=..., parallelism=...)`` at
  ``sp=4``, ``sp=8`` and ``tp=2,sp=4`` (token counts that 8 does not divide) against the same
  checkpoint on one device, within 1e-4 (the fast tier samples one mesh per family:
  ``tests/sweep.py``; ``make test-all`` runs all 24);
- ``vidax generate --mesh sp=8,ring=2`` end to end, one program per step;
- one-line refusals naming the heads / tokens;
- shard reads: every family's DiT loaded at ``tp=2`` reads each query projection as two halves of
  its rows, in one process and in two (``jax.distributed`` on loopback; the fast tier runs Wan and
  1 of the other 7 families there).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests import sweep
from tests.refutil import assert_parity
from vidax import compat
from vidax.core import mesh as vmesh
from vidax.core import sharding as vsh
from vidax.core.attention import dense_attention


# ----------------------------------------------------------------------------------- the core unit
@pytest.mark.parametrize("spec,impl", sweep.sample([("sp=8", None), ("sp=8,ring=8", None), ("sp=8,ring=4", None),
                                                    ("dp=2,sp=4,ring=2", None), ("tp=2,sp=4", None),
                                                    ("sp=4,ring=2", "splash")], 2, "usp-unit"))
def test_usp_attention_matches_dense(spec, impl):
    """Joint [sequence; prompt] attention, 21 sequence tokens (padded to the sp multiple, masked),
    5 prompt tokens with a key mask, prompt queries too: the same as one dense attention. With
    ``impl="splash"`` every ring step is the Pallas splash kernel (its log-sum-exp residual merged;
    interpret mode off TPU)."""
    rng = np.random.default_rng(0)
    b, h, d, n, ne = 2, 2, 8, 21, 5
    q, k, v = (jnp.asarray(rng.normal(size=(b, n, h, d)), jnp.float32) for _ in range(3))
    eq, ek, ev = (jnp.asarray(rng.normal(size=(b, ne, h, d)), jnp.float32) for _ in range(3))
    em = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    mask = jnp.concatenate([jnp.ones((b, n), bool), em], 1)[:, None, None, :]
    ref = dense_attention(jnp.concatenate([q, eq], 1), jnp.concatenate([k, ek], 1), jnp.concatenate([v, ev], 1),
                          mask=mask)
    mesh = vmesh.make_mesh(spec)
    sp, tp, dp = mesh.shape["sp"], mesh.shape["tp"], mesh.shape["dp"]
    ring = vmesh.ring_degree(spec)
    u, r = vmesh.usp_split(sp, h // tp, ring)
    assert u * r == sp and (r > 1 or u == sp)
    to = -(-n // sp) * sp

    def pad(t):
        return jnp.pad(t, ((0, 0), (0, to - n), (0, 0), (0, 0)))

    def f(q, k, v, eq, ek, ev, em):
        return vsh.usp_attention(q, k, v, axis_size=sp, ring=ring, valid=n, extra_q=eq, extra_k=ek, extra_v=ev,
                                 extra_mask=em, impl=impl)

    bs, hs = ("dp" if dp > 1 else None), ("tp" if tp > 1 else None)
    s, e = P(bs, "sp", hs, None), P(bs, None, hs, None)
    o, oe = vsh.smap(f, mesh, (s, s, s, e, e, e, P(bs, None)), (s, e))(pad(q), pad(k), pad(v), eq, ek, ev, em)
    assert_parity(o[:, :n], ref[:, :n], tol=1e-5, what=f"{spec} (ulysses {u} x ring {r}) sequence")
    assert_parity(oe, ref[:, n:], tol=1e-5, what=f"{spec} prompt queries")


def test_splash_ring_step_matches_dense():
    """The ring step's unit: splash's saved log-sum-exp equals the dense path's, fully masked rows
    included (a finite, hugely negative lse: zero weight in the merge)."""
    from vidax.core import attention as A

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 40, 2, 12)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 12)), jnp.float32) for _ in range(2))
    for km in (jnp.asarray(np.arange(24)[None] < np.array([[24], [10]])), jnp.zeros((1, 24), bool)):
        (o1, l1), (o2, l2) = (A.attention_lse(q, k, v, kmask=km, impl=i) for i in ("splash", "xla"))
        assert l1.shape == (2, 2, 40) and np.isfinite(np.asarray(o1)).all()
        if bool(km.any()):
            assert_parity(o1, o2, tol=1e-5, what="splash ring step")
            assert_parity(l1, l2, tol=1e-5, what="splash log-sum-exp")
        else:
            assert float(l1.max()) < -1e37 and float(l2.max()) < -1e37


def test_usp_split_and_ring_specs():
    assert vmesh.usp_split(8, 2) == (2, 4)  # the largest Ulysses degree the heads allow
    assert vmesh.usp_split(8, 12) == (4, 2)
    assert vmesh.usp_split(16, 12) == (4, 4)
    assert vmesh.usp_split(8, 2, ring=4) == (2, 4)
    assert vmesh.usp_split(4, 1) == (1, 4)  # pure ring
    assert vmesh.ring_degree("sp=8,ring=2") == 2 and vmesh.ring_degree("sp=8") is None
    assert vmesh.parse_mesh_spec("sp=8,ring=2") == {"dp": 1, "tp": 1, "sp": 8}  # ring is no mesh axis
    assert vmesh.make_mesh("sp=8,ring=2").shape["sp"] == 8
    with pytest.raises(vmesh.ShardingConfigError, match=r"ring=3 does not divide sp=8 .*valid ring: 1, 2, 4, 8"):
        vmesh.parse_mesh_spec("sp=8,ring=3")
    with pytest.raises(vmesh.ShardingConfigError, match=r"sp/ring=4 does not divide the 2 attention heads per tp "
                                                        r"shard; valid ring: 4, 8"):
        vmesh.usp_split(8, 2, ring=2)


def test_impossible_meshes_are_refused_naming_heads_or_tokens():
    from vidax.models.wan import dit

    cfg = dit.PRESETS["tiny"]  # 2 heads
    rules = dit.parallel_constraints(cfg, tokens=6)
    vmesh.check_divisible(dit.parallel_constraints(cfg, tokens=36), "sp=8")  # 2 heads, sp=8: Ulysses 2 x ring 4
    vmesh.check_divisible(dit.parallel_constraints(cfg, tokens=36), "tp=2,sp=4")
    with pytest.raises(vmesh.ShardingConfigError) as e:
        vmesh.check_divisible(rules, "sp=8")
    assert str(e.value).count("\n") == 0 and "sp=8 exceeds the 6 tokens" in str(e.value) and "valid sp: 1 to 6" in str(e.value)
    with pytest.raises(vmesh.ShardingConfigError, match=r"num_heads=2: sp=8,ring=2: the Ulysses degree sp/ring=4 "
                                                        r"does not divide the 2 attention heads per tp shard"):
        vmesh.check_divisible(dit.parallel_constraints(cfg), "sp=8,ring=2")
    with pytest.raises(vmesh.ShardingConfigError, match=r"tp=4 does not divide num_heads=2"):
        vmesh.check_divisible(dit.parallel_constraints(cfg), "tp=4,sp=2")


# ----------------------------------------------------------------------------------- every family
def _wan():
    from tests import test_wan_dit as T

    return T._ref(), T._inputs(T.TINY)  # 3x3x4 = 36 tokens


def _cogvideox():
    from tests import test_cogvideox_dit as T

    cfg = {**T.BASE, **T.VARIANTS["5b"]}
    return T._ref("5b"), T._inputs(cfg, h=6, w=10)  # joint text + 3x3x5 = 45 video tokens


def _hunyuanvideo():
    from diffusers import HunyuanVideoTransformer3DModel

    from tests import test_hunyuanvideo_dit as T
    from tests.refutil import perturb
    import torch

    torch.manual_seed(0)
    return perturb(HunyuanVideoTransformer3DModel(**T.TINY), seed=1), T._inputs(4)  # 36 video tokens + text


def _hunyuanvideo15():
    from diffusers import HunyuanVideo15Transformer3DModel

    from tests import test_hunyuanvideo15_dit as T
    from tests.refutil import perturb
    import torch

    torch.manual_seed(0)
    kw = T._inputs("t2v")
    kw["hidden_states"] = kw["hidden_states"][:, :, :, :5, :7].copy()  # 3x5x7 = 105 video tokens
    return perturb(HunyuanVideo15Transformer3DModel(**{**T.TINY, **T.VARIANTS["t2v"]}), seed=1), kw


def _ltx():
    from diffusers import LTXVideoTransformer3DModel

    from tests import test_ltx_dit as T
    from tests.refutil import perturb
    import torch

    torch.manual_seed(0)
    ref = perturb(LTXVideoTransformer3DModel(**{**T.TINY, "num_attention_heads": 2, "attention_head_dim": 20}), seed=1)
    return ref, T._inputs(f=3, h=4, w=5)  # 60 tokens


def _ltx2():
    from diffusers import LTX2VideoTransformer3DModel

    from tests import test_ltx2_models as T
    from tests.refutil import perturb
    import torch

    torch.manual_seed(0)
    ref = perturb(LTX2VideoTransformer3DModel(**T.DIT), seed=1)
    rng = np.random.default_rng(3)
    kw = T._dit_inputs(ref, hidden_states=rng.standard_normal((2, 27, 8)).astype(np.float32), num_frames=3,
                       height=3, width=3)  # 27 video tokens (and the audio stream whole on every device)
    return ref, kw


def _cosmos():
    from diffusers import CosmosTransformer3DModel

    from tests import test_cosmos_dit as T
    from tests.refutil import perturb
    import torch

    T.install_torchvision_shim()
    torch.manual_seed(0)
    return perturb(CosmosTransformer3DModel(**T.TINY), seed=1), T._inputs(T.TINY)  # 3x3x5 = 45 tokens


def _cosmos3():
    from tests import test_cosmos3_mot as T

    cfg = dict(T.QWEN, num_attention_heads=2, num_key_value_heads=2)
    return T._ref(cfg), T._packed(cfg, und_len=6, h=5, w=6, per_token_t=True)  # 3x3x3 = 27 vision tokens


FAMILIES = {"wan": _wan, "cogvideox": _cogvideox, "hunyuanvideo": _hunyuanvideo, "hunyuanvideo15": _hunyuanvideo15,
            "ltx": _ltx, "ltx2": _ltx2, "cosmos": _cosmos, "cosmos3": _cosmos3}
MESHES = [("sp=4", "sp"), ("sp=8", "sp"), ("tp=2,sp=4", "tp+sp")]
CASES = sweep.sample_per_group([(f, m, p) for f in FAMILIES for m, p in MESHES], lambda c: c[0], 1, "usp-families")


def _arrays(out):
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in _arrays(o)]
    return [np.asarray(out)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Each family's checkpoint folder and inputs, built on first use (no JAX program compiled)."""
    cache = {}

    def get(name):
        if name not in cache:
            ref, kw = FAMILIES[name]()
            path = tmp_path_factory.mktemp(f"usp_{name}")
            ref.save_pretrained(path)
            cache[name] = (path, kw)
        return cache[name]
    return get


@pytest.fixture(scope="module")
def family(checkpoint):
    """Each family's checkpoint folder, inputs and single-device output, built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            path, kw = checkpoint(name)
            cache[name] = (path, kw, _arrays(compat.load_pretrained(path).forward(**kw)))
        return cache[name]
    return get


@pytest.mark.parametrize("name,mesh,parallelism", CASES)
def test_family_on_usp_mesh_matches_one_device(family, name, mesh, parallelism):
    path, kw, one = family(name)
    m = compat.load_pretrained(path, mesh=mesh, parallelism=parallelism)
    out = _arrays(m.forward(**kw))
    assert len(out) == len(one)
    for i, (o, r) in enumerate(zip(out, one)):
        assert_parity(o, r, tol=1e-4, what=f"{name} mesh={mesh} output {i}")


def test_ring_given_in_the_mesh_spec_and_offloaded(family):
    """``sp=8,ring=8`` (pure ring) through load_pretrained, and an offloaded USP run (the padded
    token count travels into the chunk programs as an argument)."""
    path, kw, one = family("wan")
    for opts in (dict(mesh="sp=8,ring=8", parallelism="sp"), dict(mesh="sp=8", parallelism="sp", offload_chunk_size=1)):
        m = compat.load_pretrained(path, **opts)
        assert m.runner.ring == (8 if "ring" in opts["mesh"] else None)
        assert_parity(_arrays(m.forward(**kw))[0], one[0], tol=1e-4, what=f"wan {opts}")
    with pytest.raises(vmesh.ShardingConfigError, match="does not divide the 2 attention heads"):
        compat.load_pretrained(path, mesh="sp=8,ring=2", parallelism="sp")


# ----------------------------------------------------------------------------------- the CLI
def test_generate_with_a_ring_mesh_matches_one_device(seeded_store, tmp_path, capsys):
    """``vidax generate --mesh`` on the tiny 2-head Wan: ``sp=8,ring=2`` (Ulysses 4 does not divide
    2 heads) is refused in one line, exit 2, nothing written; ``sp=3`` (a ring of 3 devices, 8
    video tokens padded to 9) runs one step program and its latents match the session's one-device
    run of the same request (``seeded_store``)."""
    from stages import cli
    from stages.store import RunStore, read_array
    from vidax.core import sampling

    url = f"file://{tmp_path}"
    base = ["generate", "--prompt", "a lighthouse", "--frames", "5", "--steps", "1", "--height", "32", "--width", "32",
            "--store", url]
    assert cli.main(base + ["--mesh", "sp=8,ring=2", "--run-id", "bad"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "sp/ring=4" in line]
    assert len(err) == 1 and "does not divide the 2 attention heads" in err[0], err
    assert not (tmp_path / "runs" / "bad").exists()
    sampling._STEPS.clear()
    assert cli.main(base + ["--mesh", "sp=3", "--run-id", "usp"]) == 0
    assert len(sampling._STEPS) == 1  # one step program for every step
    run = RunStore(url).run("usp")
    assert run.record("sample")["details"]["mesh"] == "sp=3"
    ref = read_array(RunStore(f"file://{seeded_store}").run("keep").group("sample.zarr"), "latents")
    assert_parity(read_array(run.group("sample.zarr"), "latents"), ref, tol=1e-4, what="generate --mesh sp=3 latents")


# ----------------------------------------------------------------------------------- vidax plan
def test_plan_accounts_for_usp():
    """``vidax plan`` compiles the USP step (2 heads on sp=8: Ulysses 2 x ring 4, 18 tokens padded
    to 24) and reports what sequence parallelism sends per device per step, from the traced
    program's local shapes times the layers."""
    from stages.plan import plan

    p = plan("wan2.1-t2v-1.3b", preset="tiny", mesh="sp=8", height=48, width=48, num_frames=5)
    sample = next(s for s in p.stages if s.kind == "sample")
    unit = sample.units[0]
    b = int(unit.note.split()[1])  # "batch 2 x 18 tokens"
    layers, heads, hd, f32 = 2, 2, 12, 4
    local = b * (24 // 8) * heads * hd * f32  # one of q / k / v on one device before the all_to_all
    assert unit.comm == {"all_to_all": layers * 4 * local // 2,  # q, k, v and the output, half of each leaves
                         "ring": layers * 3 * 2 * (b * (24 // 4) * (heads // 2) * hd * f32)}  # k, v: 3 hops
    assert "sequence parallel sends" in p.table() and "ring K/V" in p.table()
    assert sample.to_json()["units"][0]["sp_comm"] == unit.comm


# ----------------------------------------------------------------------------------- shard reads
_Q = ("to_q.weight", "q_proj.weight")  # every family's attention query projection, reference layout [out, in]


def _spy_reads(monkeypatch):
    from vidax.weights.io import LazyTensor

    reads = []
    orig = LazyTensor.read

    def spy(self, index=None):
        reads.append((self.name, tuple(self.shape), index))
        return orig(self, index)
    monkeypatch.setattr(LazyTensor, "read", spy)
    return reads


def _rows(index, shape):
    """The (start, stop) of dim 0 a read covered (the whole tensor for ``index=None``)."""
    if index is None:
        return (0, shape[0])
    i = index[0] if isinstance(index, tuple) else index
    return (i.start or 0, shape[0] if i.stop is None else i.stop) if isinstance(i, slice) else (int(i), int(i) + 1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_device_reads_only_its_rows(family, name, monkeypatch):
    """``load_pretrained(mesh="tp=2")``: no checkpoint tensor is read whole by a device that
    holds a part of it; every query projection ([out, in], column-parallel) is read as exactly two
    halves of its rows, one per device, and nothing else of it."""
    path, kw, one = family(name)
    reads = _spy_reads(monkeypatch)
    m = compat.load_pretrained(path, mesh="tp=2", parallelism="tp")
    q = [r for r in reads if r[0].endswith(_Q) and "token_refiner" not in r[0]]  # the prompt refiner stays whole
    assert q and all(r[2] is not None for r in reads), "a tensor was read whole"
    by_tensor: dict = {}
    for n, shape, index in q:
        by_tensor.setdefault((n, shape), []).append(_rows(index, shape))
    for (n, shape), rows in by_tensor.items():
        half = shape[0] // 2
        assert sorted(rows) == [(0, half), (half, shape[0])], f"{n}: rows read {rows}"
    if name == "wan":  # and the model placed that way computes what one device computes
        assert_parity(_arrays(m.forward(**kw))[0], one[0], tol=1e-4, what="wan tp=2, lazily placed")


_TWO_PROCESS_SCRIPT = r"""
import json, sys
from vidax.core import mesh as vmesh
vmesh.init_distributed()
import jax
from jax.sharding import NamedSharding
from vidax.weights.io import LazyTensor
reads = []
orig = LazyTensor.read
def spy(self, index=None):
    box = None if index is None else [[s.start, s.stop] if isinstance(s, slice) else [int(s), int(s) + 1]
                                      for s in (index if isinstance(index, tuple) else (index,))]
    reads.append([self.name, list(self.shape), box])
    return orig(self, index)
LazyTensor.read = spy
from vidax import compat
m = compat.load_pretrained(sys.argv[1], mesh="tp=2", parallelism="tp")
first = list(reads)  # the tp=2 load's reads
held = []  # every array the runner holds split over tp (any family's runner): global shape, split dims, local shards
for attr, part in vars(m.runner).items():
    for path, a in jax.tree_util.tree_flatten_with_path(part)[0]:
        if not (isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding)):
            continue
        dims = [d for d, ax in enumerate(a.sharding.spec) if ax == "tp" or (isinstance(ax, tuple) and "tp" in ax)]
        if dims:
            held.append([attr + jax.tree_util.keystr(path), list(a.shape), dims,
                         [list(s.data.shape) for s in a.addressable_shards]])
if len(sys.argv) > 2:  # Wan: the same DiT on a ring across the two processes
    import numpy as np
    kw = dict(np.load(sys.argv[2]))
    ring = compat.load_pretrained(sys.argv[1], mesh="sp=2,ring=2", parallelism="sp").forward(**kw)
    np.save(sys.argv[3], np.asarray(ring))
print(json.dumps({"reads": first, "held": held}))
"""

# each case: two JAX processes (10-16 s CPU at level 0). Wan (and its cross-host ring) always; 1 of the other 7
TWO_PROCESS = ["wan"] + sweep.sample([f for f in FAMILIES if f != "wan"], 1, "two-process-reads")


def _two_processes(args, root):
    """Run :data:`_TWO_PROCESS_SCRIPT` with ``args`` as two processes (one fake CPU device each,
    ``jax.distributed`` on loopback); their JSON reports."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from tests.sweep import xla_flags

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIDAX_") or k == "VIDAX_FAMILIES"}
    env.update(XLA_FLAGS=xla_flags(1), JAX_PLATFORMS="cpu", VIDAX_COMPILE_CACHE="off", PYTHONPATH=str(root),
               VIDAX_COORDINATOR=f"127.0.0.1:{port}", VIDAX_NUM_PROCESSES="2", VIDAX_DISTRIBUTED_TIMEOUT="30")
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_SCRIPT, *(a(i) for a in args)], cwd=root, text=True,
                              env={**env, "VIDAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("name", TWO_PROCESS)
def test_two_processes_each_read_only_their_rows(checkpoint, family, name, tmp_path):
    """Two processes (one fake device each, ``jax.distributed`` on loopback) load the family's DiT
    with ``mesh="tp=2"``: each reads exactly its own half of the rows of every query projection
    (the two halves together, no overlap), neither reads any tensor whole, and each holds only its
    half of every array split over ``tp`` (a query kernel among them). For Wan, the same DiT on
    ``sp=2,ring=2`` (the ring's K/V hops cross the two processes) also computes what one device
    does. (``make test`` runs Wan and 1 of the other 7 families: ``tests/sweep.py``.)"""
    from pathlib import Path

    path, kw = checkpoint(name)
    args = [lambda i: str(path)]
    if name == "wan":
        np.savez(tmp_path / "kw.npz", **kw)
        args += [lambda i: str(tmp_path / "kw.npz"), lambda i: str(tmp_path / f"ring{i}.npy")]
    outs = _two_processes(args, Path(__file__).resolve().parent.parent)
    rows = []  # per process: {query tensor: its rows read}
    for i, o in enumerate(outs):
        assert o["reads"] and all(r[2] is not None for r in o["reads"]), f"process {i}: a tensor was read whole"
        mine: dict = {}
        for n, shape, box in o["reads"]:
            if n.endswith(_Q) and "token_refiner" not in n:  # the prompt refiner stays whole
                mine.setdefault((n, tuple(shape)), []).append(_rows(tuple(slice(a, b) for a, b in box), shape))
        assert mine, f"process {i}: no query projection read"
        rows.append(mine)
        assert any("['q']" in p and "kernel" in p for p, *_ in o["held"]), f"process {i}: no query kernel split over tp"
        for p, shape, dims, local in o["held"]:
            want = [s // 2 if d in dims else s for d, s in enumerate(shape)]
            assert local == [want], f"process {i}: {p} {shape} split on {dims}: holds {local}"
    assert rows[0].keys() == rows[1].keys()
    for key in rows[0]:
        n, shape = key
        half = shape[0] // 2
        assert len(rows[0][key]) == len(rows[1][key]) == 1, f"{n}: rows read {rows[0][key]}, {rows[1][key]}"
        assert sorted(rows[0][key] + rows[1][key]) == [(0, half), (half, shape[0])], \
            f"{n}: rows read {rows[0][key]} and {rows[1][key]}"
    if name == "wan":
        one = family("wan")[2]
        for i in range(2):
            assert_parity(np.load(tmp_path / f"ring{i}.npy"), one[0], tol=1e-4,
                          what=f"process {i}: sp=2,ring=2 across hosts")
