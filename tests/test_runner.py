"""The one DiT runner (vidax.core.runner) on a toy model with two block stacks of different shapes
and a ``link`` between them: resident, offloaded (one pool and one chunk program per stack) and
sharded (tp, sp) all equal the model's own one-device call; activations are laid out by their
logical names through the one table."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
