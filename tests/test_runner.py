"""The one DiT runner (vidax.core.runner) on a toy model with two block stacks of different shapes
and a ``link`` between them: resident, offloaded (one pool and one chunk program per stack) and
sharded (tp, sp) all equal the model's own one-device call; activations are laid out by their
logical names through the one table."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dataclasses import replace as dataclasses_replace

from flax import nnx

from vidax.core import nn
from vidax.core import sharding as vsh
from vidax.core.jit import CompileCounter
from vidax.core.runner import DiTRunner

D, F = 8, 16


class Embed(nnx.Module):
    def __init__(self, rngs):
        self.proj = nn.Linear(4, D, rngs=rngs, axes=(None, "embed"))

    def __call__(self, a, par=vsh.LOCAL):
        return {"h": self.proj(a["tokens"])}, {"scale": a["scale"]}


class BlockA(nnx.Module):  # feed-forward, split by ffn under tp
    def __init__(self, rngs):
        self.up = nn.Linear(D, F, rngs=rngs, axes=("embed", "ffn"))
        self.down = nn.Linear(F, D, rngs=rngs, axes=("ffn", "embed"))


class BlockB(nnx.Module):  # reads the linked carry's second stream
    def __init__(self, rngs):
        self.mix = nn.Linear(D, D, rngs=rngs)


class Head(nnx.Module):
    def __init__(self, rngs):
        self.out = nn.Linear(D, 4, rngs=rngs, axes=("embed", None))

    def __call__(self, carry, c, par=vsh.LOCAL):
        return {"y": self.out(carry["h"] + carry["g"])}


class Toy(nnx.Module):
    STACKS = ("a", "b")

    def __init__(self, rngs):
        self.embed = Embed(rngs)
        self.a = nn.stack(lambda r: BlockA(r), 4, rngs)
        self.b = nn.stack(lambda r: BlockB(r), 2, rngs)
        self.head = Head(rngs)

    @staticmethod
    def step_a(blk, carry, c, par):
        return {"h": carry["h"] + par.linear(blk.down, jnp.tanh(par.linear(blk.up, carry["h"]))) * c["scale"][:, None, None]}

    @staticmethod
    def link_b(carry, c, par):
        return {"h": carry["h"], "g": 0.5 * carry["h"]}

    @staticmethod
    def step_b(blk, carry, c, par):
        return {"h": carry["h"] + jnp.tanh(blk.mix(carry["g"])), "g": carry["g"] * 0.9}

    @staticmethod
    def act_spec(name, shape):
        if name in ("tokens", "h", "g", "y"):
            return ("batch", "tokens", None)
        return ("batch", *(None,) * (len(shape) - 1))

    def __call__(self, inputs):
        carry, c = self.embed(inputs)
        carry = nn.scan(self.a, carry, lambda blk, cy: self.step_a(blk, cy, c, vsh.LOCAL))
        carry = nn.scan(self.b, self.link_b(carry, c, vsh.LOCAL), lambda blk, cy: self.step_b(blk, cy, c, vsh.LOCAL))
        return self.head(carry, c)


@pytest.fixture(scope="module")
def toy():
    model = nn.perturb(Toy(nnx.Rngs(0)), seed=1)
    rng = np.random.default_rng(0)
    inputs = {"tokens": jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.float32),
              "scale": jnp.asarray([1.0, 0.5], jnp.float32)}
    ref = np.asarray(jax.jit(lambda m, a: m(a))(model, inputs)["y"])
    return model, inputs, ref


@pytest.mark.parametrize("mesh,chunk", [(None, None), ("tp=2", None), ("sp=2", None), ("dp=2,tp=2,sp=2", None),
                                        (None, {"a": 2, "b": 1}), ("tp=2,sp=2", 2)])
def test_two_stacks_with_a_link(toy, mesh, chunk):
    model, inputs, ref = toy
    abstract = nnx.eval_shape(lambda: Toy(nnx.Rngs(0)))
    r = DiTRunner(abstract, jax.tree.map(np.asarray, nnx.state(model)), mesh, offload_chunk_size=chunk)
    out = np.asarray(r(inputs)["y"])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    if chunk is not None:
        pools = r.offload.pools
        assert set(pools) == {"a", "b"} and pools["a"].num_layers == 4 and pools["b"].num_layers == 2
        again = {**inputs, "scale": jnp.asarray([2.0, 1.0], jnp.float32)}  # new values, same shapes
        with CompileCounter() as cc:
            r(again)["y"].block_until_ready()
        assert cc.count == 0 and all(p.fn._cache_size() == 1 for p in pools.values())
    if mesh and "tp" in mesh and chunk is None:  # ffn split over tp by the one table
        up = r.stacks["a"]["up"]["kernel"].get_value()
        assert up.addressable_shards[0].data.shape == (4, D, F // 2)
    if mesh and "sp" in mesh:  # tokens over sp, batch over dp: logical names through the table
        assert r.act_spec("h", (2, 8, D)) == vsh.logical_spec(("batch", "tokens", None), vsh.axis_rules(r.parallelism), r.mesh)
        assert r.act_spec("h", (2, 8, D))[1] == "sp"


@pytest.mark.parametrize("chunk", [None, {"a": 2, "b": 1}])
def test_indivisible_tokens_are_padded(toy, chunk):
    """6 tokens on sp=4: padded to 8 inside the programs (the offloaded chunks and the link get the
    real count as an argument), cut back to 6 before the output leaves."""
    model, inputs, _ = toy
    six = {**inputs, "tokens": inputs["tokens"][:, :6]}
    want = np.asarray(jax.jit(lambda m, a: m(a))(model, six)["y"])
    abstract = nnx.eval_shape(lambda: Toy(nnx.Rngs(0)))
    r = DiTRunner(abstract, jax.tree.map(np.asarray, nnx.state(model)), "sp=4", offload_chunk_size=chunk)
    assert r.token_count(six) == 6 and r.token_count(inputs) is None  # 8 tokens divide sp=4: no padding
    out = np.asarray(r(six)["y"])
    assert out.shape == want.shape and np.max(np.abs(out - want)) <= 1e-5 * np.max(np.abs(want))


_TRACED: list = []


def test_abstract_states_are_traced_once_per_builder_and_handed_out_fresh():
    """``nn.abstract_state`` traces a builder once per (code, closed-over values) and gives each
    caller its own state: filling one leaves the next caller's abstract; another config, or a
    builder closing over an object that may change, is traced anew."""
    from vidax.models.wan import dit as wdit

    tiny = wdit.PRESETS["tiny"]
    wider = dataclasses_replace(tiny, num_layers=tiny.num_layers + 1)
    traced = _TRACED
    traced.clear()

    def build(cfg):
        def make():
            _TRACED.append(cfg)  # a global: the builder closes over the config alone
            return wdit.KIT.build(cfg)
        return make

    a = nn.abstract_state(build(tiny))[1]
    b = nn.abstract_state(build(tiny))[1]
    assert traced == [tiny]  # one trace for two callers
    nn.fill(a, jax.tree.map(lambda s: np.ones(s.shape, s.dtype), nnx.to_pure_dict(a)))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(b))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nn.abstract_state(build(tiny))[1]))
    nn.abstract_state(build(wider))
    assert traced == [tiny, wider]  # another config: traced

    class Holder:  # a mutable object: what it builds may change, so it is never cached
        cfg = tiny

    h = Holder()
    nn.abstract_state(lambda: (traced.append(h.cfg), wdit.KIT.build(h.cfg))[1])
    nn.abstract_state(lambda: (traced.append(h.cfg), wdit.KIT.build(h.cfg))[1])
    assert traced == [tiny, wider, tiny, tiny]
    # the family kit's shapes, state and graph definitions share one trace per (config, dtype)
    assert nn.shapes(lambda: wdit.KIT.build(tiny)) == wdit.KIT.param_shapes(tiny)
    assert jax.tree.leaves(wdit.KIT.param_shapes(wider))[0].shape != () and \
        len(jax.tree.leaves(wdit.KIT.param_shapes(wider))) == len(jax.tree.leaves(wdit.KIT.param_shapes(tiny)))


def test_abstract_builds_in_threads_leave_jax_tracer_messages_as_they_were():
    """The origin walk skipped while modules' constructions are traced (``nn._NoTracerOrigins``)
    comes back when the last of several concurrent builds ends (a batch builds in threads)."""
    import threading

    from jax._src.interpreters import partial_eval as pe

    from vidax.models.wan import dit as wdit

    before = pe.DynamicJaxprTracer._origin_msg
    cfgs = [dataclasses_replace(wdit.PRESETS["tiny"], num_layers=n) for n in (3, 4, 5)]
    threads = [threading.Thread(target=lambda c=c: nn.abstract_state(lambda: wdit.KIT.build(c))) for c in cfgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pe.DynamicJaxprTracer._origin_msg is before
    with pytest.raises(Exception, match="occurred while tracing"):  # JAX's message names the origin again
        jax.jit(lambda x: int(x))(1.0)
