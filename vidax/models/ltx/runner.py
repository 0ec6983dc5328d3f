"""A stacked-block DiT on a ``(dp, tp, sp)`` mesh, resident or offloaded (the LTX DiTs share it).

A model here is three NNX units, as :mod:`vidax.models.wan.dit` splits Wan's:

- ``embed(inputs: dict, par) -> (carry: dict, consts: dict)``: everything before the blocks;
- ``blocks``: one block stacked ``num_layers`` times, run with ``lax.scan`` by the model's static
  ``step(block, carry, consts, par) -> carry``;
- ``head(carry, consts, par) -> outputs: dict``.

Every activation is a named array; the model's ``act_spec(name, shape) -> PartitionSpec`` says
how it is laid out on the mesh (the batch over ``dp``, tokens over ``sp``, rotary tables' width
over ``tp`` with the heads...). Inside ``shard_map`` each unit runs on its shard with a
:class:`~vidax.core.sharding.ParallelContext` (row-parallel linears reduce once and add their bias
once, q/k norms reduce their statistics, self-attention goes through Ulysses). Weights are placed
by their logical axes through the model's ``AXIS_RULES``; with ``offload_chunk_size`` the stacked
block state streams from host memory through one compiled chunk function
(:class:`vidax.core.offload.OffloadRunner`).
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from vidax.core import mesh as vmesh
from vidax.core import offload as voff
from vidax.core import sharding as vsh


def _rest(state) -> nnx.State:
    return nnx.State({k: v for k, v in state.items() if k != "blocks"})


class DiTRunner:
    """``model``: an abstract (or concrete) module with ``embed``, ``blocks``, ``head`` and the
    class attributes/methods ``step``, ``act_spec``, ``AXIS_RULES``; ``state``: its state (host
    numpy preferred). ``constraints(cfg)``: model-level divisibility rules."""

    def __init__(self, model, state, mesh=None, parallelism: str | None = None, *, constraints: list = (),
                 offload_chunk_size=None, prefetch: bool = True, attn_impl: str | None = None,
                 track_memory: bool = False):
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        self.model_cls = type(model)
        self.graphs = {k: nnx.graphdef(getattr(model, k)) for k in ("embed", "blocks", "head")}
        self.mesh = vmesh.make_mesh(mesh)
        self.parallelism = vsh.resolve_parallelism(parallelism, self.mesh)
        vmesh.check_divisible(list(constraints), self.mesh)
        mapping = vsh.logical_mapping(self.parallelism, self.model_cls.AXIS_RULES)
        self.par = vsh.ParallelContext.create(mapping, self.mesh, attn_impl=attn_impl)
        self.specs = vsh.param_specs(state, mapping)
        vsh.check_param_divisibility(state, self.specs, self.mesh)
        self.rest_specs, self.block_specs = _rest(self.specs), self.specs["blocks"]
        self.rest = vsh.place(_rest(state), vsh.named_shardings(self.mesh, self.rest_specs))
        block_shardings = vsh.named_shardings(self.mesh, self.block_specs)
        self.offload = None
        if offload_chunk_size is None:
            self.blocks = vsh.place(state["blocks"], block_shardings)
            self._fwd = jax.jit(self._resident)
        else:
            self.blocks = None
            self.offload = voff.OffloadRunner(prefetch=prefetch, track_memory=track_memory)
            self.offload.add_stack("blocks", state["blocks"], self._chunk, offload_chunk_size, block_shardings)
            self._pre = jax.jit(self._prologue)
            self._post = jax.jit(self._epilogue)

    # ------------------------------------------------------------------ specs
    def _specs(self, tree):
        """The model's activation specs, with mesh axes of size 1 dropped (an axis named in a spec
        makes a value "varying" over it inside shard_map, even when it has one device)."""
        spec, sizes = self.model_cls.act_spec, vmesh.axis_sizes(self.mesh)

        def one(k, v):
            s = spec(k, tuple(v.shape))
            return P(*[a if a is None or sizes[a] > 1 else None for a in s])

        return {k: (self._specs(v) if isinstance(v, dict) else one(k, v)) for k, v in tree.items()}

    def _gathered(self, tree):
        """Specs with the token axis (sp) gathered: what leaves the runner."""
        def one(s):
            return P(*[None if a == "sp" else a for a in s])
        return {k: (self._gathered(v) if isinstance(v, dict) else one(v)) for k, v in tree.items()}

    def _smap(self, fn, in_specs, out_specs):
        return vsh.smap(fn, self.mesh, in_specs, out_specs)

    # ------------------------------------------------------------------ units, merged inside shard_map
    def _embed(self, rest, inputs, par):
        return nnx.merge(self.graphs["embed"], rest["embed"])(inputs, par)

    def _scan(self, blocks, carry, consts, par):
        step = self.model_cls.step
        graph = self.graphs["blocks"]

        def body(c, s):
            return step(nnx.merge(graph, s), c, consts, par), None

        out, _ = jax.lax.scan(body, carry, blocks)
        return out

    def _head(self, rest, carry, consts, par):
        return nnx.merge(self.graphs["head"], rest["head"])(carry, consts, par)

    def _shapes(self, rest, inputs):
        return jax.eval_shape(lambda r, a: self._embed(r, a, vsh.LOCAL), rest, inputs)

    def _resident(self, rest, blocks, inputs):
        carry_s, consts_s = self._shapes(rest, inputs)
        out_s = jax.eval_shape(lambda r, c, k: self._head(r, c, k, vsh.LOCAL), rest, carry_s, consts_s)

        def inner(rest, blocks, a):
            carry, consts = self._embed(rest, a, self.par)
            carry = self._scan(blocks, carry, consts, self.par)
            return self._head(rest, carry, consts, self.par)

        out_specs = self._specs(out_s)
        y = self._smap(inner, (self.rest_specs, self.block_specs, self._specs(inputs)), out_specs)(rest, blocks, inputs)
        return self._gather(y, out_specs)

    def _gather(self, y, specs):
        gathered = self._gathered(specs)
        return jax.tree.map(lambda a, s: vsh.with_constraint(a, self.mesh, s), y, gathered,
                            is_leaf=lambda x: isinstance(x, P))

    def _prologue(self, rest, inputs):
        carry_s, consts_s = self._shapes(rest, inputs)
        return self._smap(lambda r, a: self._embed(r, a, self.par), (self.rest_specs, self._specs(inputs)),
                          (self._specs(carry_s), self._specs(consts_s)))(rest, inputs)

    def _chunk(self, blocks, carry, consts):
        return self._smap(lambda b, c, k: self._scan(b, c, k, self.par),
                          (self.block_specs, self._specs(carry), self._specs(consts)), self._specs(carry))(blocks, carry, consts)

    def _epilogue(self, rest, carry, consts):
        out_s = jax.eval_shape(lambda r, c, k: self._head(r, c, k, vsh.LOCAL), rest, carry, consts)
        out_specs = self._specs(out_s)
        y = self._smap(lambda r, c, k: self._head(r, c, k, self.par),
                       (self.rest_specs, self._specs(carry), self._specs(consts)), out_specs)(rest, carry, consts)
        return self._gather(y, out_specs)

    # ------------------------------------------------------------------ call
    def check_inputs(self, inputs: dict) -> None:
        """Every sharded input dimension divides by its mesh axes (before anything compiles): an
        error names the input, e.g. the video tokens against ``sp`` or the batch against ``dp``."""
        sizes = vmesh.axis_sizes(self.mesh)
        for name, v in inputs.items():
            spec = self.model_cls.act_spec(name, tuple(np.shape(v)))
            for d, ax in enumerate(spec):
                for a in (ax,) if isinstance(ax, str) else (ax or ()):
                    if sizes[a] > 1 and np.shape(v)[d] % sizes[a]:
                        what = {"sp": "tokens (sequence parallel)", "dp": "batch", "tp": "width"}.get(a, a)
                        raise vmesh.ShardingConfigError(
                            f"input {name!r} dim {d} (size {np.shape(v)[d]}, {what}) is not divisible by {a}={sizes[a]}")

    def __call__(self, inputs: dict) -> dict:
        inputs = {k: jax.numpy.asarray(v) for k, v in inputs.items()}
        self.check_inputs(inputs)
        if self.offload is None:
            return self._fwd(self.rest, self.blocks, inputs)
        carry, consts = self._pre(self.rest, inputs)
        carry = self.offload.run("blocks", carry, consts)
        return self._post(self.rest, carry, consts)

    @property
    def params(self):
        if self.offload is not None:
            raise ValueError("an offloading runner streams its blocks; call the runner, not apply()")
        return {"rest": self.rest, "blocks": self.blocks}

    def apply(self, params, inputs: dict) -> dict:
        """Traceable forward (params stay arguments) for a jitted sampling step."""
        self.check_inputs(inputs)
        return self._resident(params["rest"], params["blocks"], inputs)

    def lower(self, inputs: dict):
        inputs = {k: jax.numpy.asarray(v) for k, v in inputs.items()}
        return self._fwd.lower(self.rest, self.blocks, inputs)


__all__ = ["DiTRunner"]
