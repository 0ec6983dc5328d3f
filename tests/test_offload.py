"""Weight offloading: block chunks streamed from host memory through one compiled chunk function,
alone and composed with TP / SP, with and without prefetch; footprint bounded by a chunk."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import sweep
from tests.test_sharding import CFG, assert_close, inputs, perturbed_params, reference
from vidax.core import offload as vo
from vidax.core import sharding as vsh
from vidax.core.jit import CompileCounter
from vidax.models.wan import dit

OCFG = dit.WanDiTConfig(**{**CFG.__dict__, "num_layers": 4})


@pytest.fixture(scope="module")
def setup():
    params = perturbed_params(OCFG, seed=3)
    x, t, ctx = inputs(OCFG, seed=3)
    return params, (x, t, ctx), reference(params, OCFG, x, t, ctx)


@pytest.mark.parametrize("chunk,prefetch,mesh", sweep.sample([
    (1, True, None), (2, True, None), ("all", True, None), (1, False, None), (2, False, None),
    (1, True, "tp=2"), (2, False, "tp=4"), (1, True, "sp=2"), (2, True, "sp=4"), (1, True, "tp=2,sp=2"),
    (2, False, "tp=2,sp=4"),
], 5, "offload-variants"))
def test_offload_equals_resident(setup, chunk, prefetch, mesh):
    params, (x, t, ctx), ref = setup
    r = dit.runner(params, OCFG, mesh, offload_chunk_size=chunk, prefetch=prefetch)
    pool = r.offload.pools["blocks"]
    assert pool.num_chunks == OCFG.num_layers // (OCFG.num_layers if chunk == "all" else chunk)
    assert_close(r(x, t, ctx), ref, f"offload chunk={chunk} prefetch={prefetch} mesh={mesh}")
    # host copies live in host memory, each already laid out with its device sharding
    h = jax.tree.leaves(pool.host_chunks[0])[0]
    assert h.sharding.memory_kind == "pinned_host"
    assert pool.transfers == pool.num_chunks


def test_one_compiled_chunk_function(setup):
    params, (x, t, ctx), ref = setup
    r = dit.runner(params, OCFG, "tp=2", offload_chunk_size=1)
    with CompileCounter() as first:
        r(x, t, ctx).block_until_ready()
    ts = [jnp.asarray(np.asarray(t) + s) for s in range(3)]
    with CompileCounter() as again:
        for ts_ in ts:
            r(x, ts_, ctx).block_until_ready()
    print(f"compiles: first call {first.count} (prologue, chunk, epilogue), next 3 calls {again.count}")
    assert again.count == 0
    assert r.offload.pools["blocks"].fn._cache_size() == 1  # one chunk program for all 4 chunks
    assert first.count <= 4


@pytest.mark.parametrize("mesh", [None, "tp=2,sp=2"])
def test_offload_footprint_bounded_by_a_chunk(setup, mesh):
    params, (x, t, ctx), ref = setup
    resident = dit.runner(params, OCFG, mesh)
    res_ma = resident.lower(x, t, ctx).compile().memory_analysis()
    res_blocks = vsh.per_device_bytes(params["blocks"], resident.block_specs, resident.mesh)
    print(f"\nmesh={mesh}: resident forward argument bytes/device {res_ma.argument_size_in_bytes} "
          f"(block params {res_blocks}), temp {res_ma.temp_size_in_bytes}")
    print("chunk | prefetch | chunk bytes/dev | chunk-fn argument bytes | chunk-fn temp | measured peak-baseline | bound")
    for chunk in (1, 2, "all"):
        for prefetch in (True, False):
            r = dit.runner(params, OCFG, mesh, offload_chunk_size=chunk, prefetch=prefetch, track_memory=True)
            out = r(x, t, ctx)
            assert_close(out, ref, f"offload {chunk}/{prefetch}")
            pool = r.offload.pools["blocks"]
            c = pool.chunk_size
            assert pool.chunk_bytes == res_blocks * c // OCFG.num_layers
            # compiled memory analysis of the ONE chunk program
            carry, consts = r._pre(r.rest, r._pack((x, t, ctx), {})[0], r.tables({"x": x.shape}))
            a = carry
            ma = r.offload.memory_analysis("blocks", carry, consts)
            act = sum(vsh.shard_bytes(v.shape, v.dtype, v.sharding.spec, r.mesh) for v in jax.tree.leaves((carry, consts)))
            assert pool.chunk_bytes <= ma.argument_size_in_bytes <= pool.chunk_bytes + act
            # measured: live device bytes during the loop, above what was there before it
            st = r.offload.stats
            extra = st.peak_device_bytes - st.baseline_device_bytes
            h_bytes = vsh.shard_bytes(a["h"].shape, a["h"].dtype, a["h"].sharding.spec, r.mesh)
            n_res = 2 if (prefetch and pool.num_chunks > 1) else 1
            bound = n_res * pool.chunk_bytes + 2 * h_bytes
            print(f"{c} | {prefetch} | {pool.chunk_bytes} | {ma.argument_size_in_bytes} | {ma.temp_size_in_bytes} | {extra} "
                  f"| {bound}")
            assert st.peak_resident_chunks == n_res
            assert extra <= bound
            if c < OCFG.num_layers:
                assert ma.argument_size_in_bytes < res_ma.argument_size_in_bytes


def test_several_stacks_each_get_a_pool():
    """Two stacks of different shapes (e.g. two block types): one pool and one compiled chunk
    function each; result equals running both stacks resident."""
    rng = np.random.default_rng(0)
    s1 = {"w": rng.standard_normal((6, 16, 16)).astype(np.float32) * 0.2, "b": rng.standard_normal((6, 16)).astype(np.float32)}
    s2 = {"w": rng.standard_normal((4, 16, 16)).astype(np.float32) * 0.2, "g": rng.standard_normal((4, 1)).astype(np.float32)}

    def f1(p, h, scale):
        return jax.lax.scan(lambda h, q: (jnp.tanh(h @ q["w"] + q["b"]) * scale, None), h, p)[0]

    def f2(p, h, scale):
        return jax.lax.scan(lambda h, q: (h + jnp.sin(h @ q["w"]) * q["g"], None), h, p)[0]

    h0, scale = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32), jnp.float32(0.9)
    want = f2(s2, f1(s1, h0, scale), scale)
    for prefetch in (True, False):
        r = vo.OffloadRunner(prefetch=prefetch)
        r.add_stack("double", s1, f1, chunk_size=2)
        r.add_stack("single", s2, f2, chunk_size=1)
        with CompileCounter() as cc:
            out = r.run("single", r.run("double", h0, scale), scale)
        assert_close(out, want, f"two pools, prefetch={prefetch}")
        assert not h0.is_deleted()  # the runner copies the caller's carry before donating it
        # one program per pool (the second runner reuses jit's cache for the same functions)
        assert cc.count == (2 if prefetch else 0), cc.count
        assert r.pools["double"].num_chunks == 3 and r.pools["single"].num_chunks == 4


def test_chunk_size_must_divide(setup):
    params = setup[0]
    with pytest.raises(vo.OffloadConfigError, match=r"offload_chunk_size=3 does not divide num_layers=4.*valid: 1, 2, 4"):
        dit.runner(params, OCFG, None, offload_chunk_size=3)
    assert vo.resolve_chunk_size("all", 40) == 40 and vo.valid_chunk_sizes(12) == [1, 2, 3, 4, 6, 12]
