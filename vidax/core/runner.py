"""The one DiT runner: ``embed`` -> stacked blocks (one or several stacks) -> ``head`` on a
``(dp, tp, sp)`` mesh, with the block weights resident (``lax.scan``) or streamed from host
memory chunk by chunk (:class:`vidax.core.offload.OffloadRunner`).

A family writes only its hooks, on its top-level NNX module (``model``; an abstract one from
``nnx.eval_shape`` will do):

- ``embed(inputs: dict, par) -> (carry: dict, consts: dict)``: everything before the blocks;
- one stacked block module per name in ``STACKS`` (default ``("blocks",)``), each run with
  ``lax.scan`` by the static ``step(block, carry, consts, par) -> carry`` (``step_<name>`` for a
  stack other than ``blocks``); ``link_<name>(carry, consts, par) -> carry`` (optional) reshapes
  the carry before stack ``<name>`` runs (e.g. joining text and video tokens);
- ``head(carry, consts, par) -> outputs: dict``;
- ``act_spec(name, shape) -> tuple`` of *logical* axis names per activation (``("batch",
  "tokens", None)``), mapped to mesh axes by :data:`vidax.core.sharding.LOGICAL_AXES` plus the
  family's ``AXIS_DELTAS``; parameters are placed by their own logical axes through the same table.

Optional hooks: ``pack(*args, **kw) -> inputs`` (the call signature; default: one dict),
``chunk_sizes(offload_chunk_size) -> {stack: size}`` (a family's own chunk-size spec),
``prepare(inputs, dtype) -> inputs`` and ``finish(outputs, shapes) -> result`` (traceable, run
inside the compiled programs outside ``shard_map``: patchify / unpatchify), ``check(shapes, mesh)``
(input errors before anything compiles), ``table_key(shapes)`` + ``tables(key) -> dict`` (host
constants such as RoPE tables: placed once per key and passed to every program as arguments,
never compiled in).

Text K/V once (optional): ``CONTEXT`` (the inputs only the blocks' cross-attention keys and
values read, e.g. ``("ctx", "img")``; empty: none), the embed unit's ``kv_context(a, par) -> consts``
(the embedded context) and a static ``kv(block, consts, par) -> dict`` (``kv_<name>`` for another
stack): that block's keys / values, stacked over the layers by :meth:`DiTRunner.context` (or
:func:`context_local`) once per sample stage. A call given ``context=`` that tree instead of the
``CONTEXT`` inputs hands ``step`` its block's slice as ``consts["kv"]``; activations' logical axes
come from ``act_spec`` of the per-layer names. :data:`TEXT_KV_ONCE` (default on) switches it off.
``KV_FROM = {stack: source}`` (optional): that stack's K/V are computed by *another* stack, run in
sequence over the layers (a text pathway whose hidden state flows from layer to layer, Cosmos3): the
source stack is placed and streamed like the others but never runs in the forward, and
``kv_<stack>(source_block, consts, par) -> (consts, kv)`` carries the context constants through the
layers. ``prepare_context(inputs, dtype)`` (optional) replaces the default cast of the context inputs.

jit the unit: one program for the resident forward; offloaded, one prologue, one chunk program per
stack (every chunk has the same signature) and one epilogue, looped over in Python.

Any token count runs on any ``sp``: inside those programs, every activation the model's
``act_spec`` splits over ``sp`` (its ``tokens`` axis) is padded with zeros to a multiple of ``sp``
before ``shard_map``, self-attention masks the padded keys (``ParallelContext.valid``: a Python
int in the resident program, a traced scalar ``__valid__`` among an offloaded pass's constants),
and the outputs are cut back before ``finish``. Token counts that divide ``sp`` run unpadded.
"""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from vidax.core import mesh as vmesh
from vidax.core import offload as voff
from vidax.core import sharding as vsh


def _is_spec(x) -> bool:
    return isinstance(x, P)


_STATIC = (bool, int, float, str, tuple)
_VALID = "__valid__"  # an offloaded pass's real token count, among its constants (padded tokens)

#: compute the text keys / values once per sample stage (families with ``CONTEXT``); False: per step
#: as before (tests and benchmarks compare the two)
TEXT_KV_ONCE = True


def context_names(model) -> tuple:
    """The inputs a once-computed context replaces (empty: the model computes its K/V per step)."""
    return tuple(getattr(model, "CONTEXT", ()) or ()) if TEXT_KV_ONCE else ()


def _kv_hook(model, name):
    return getattr(model, "kv" if name == "blocks" else f"kv_{name}", None)


def _kv_source(model, name):
    """The stack whose layers compute stack ``name``'s K/V in sequence (``KV_FROM``), or None."""
    return dict(getattr(model, "KV_FROM", None) or {}).get(name)


def _kv_scan(fn, graph, blocks, consts, par, carried: bool = False):
    """``fn(block, consts, par)`` of every layer of a stack (state ``blocks``), stacked on axis 0;
    ``carried``: ``fn`` returns ``(consts, kv)`` and the constants flow from layer to layer (returns
    ``(consts, kv)``)."""
    if carried:
        return jax.lax.scan(lambda c, s: fn(nnx.merge(graph, s), c, par), consts, blocks)
    _, ys = jax.lax.scan(lambda c, s: (c, fn(nnx.merge(graph, s), consts, par)), None, blocks)
    return ys


def _cast_context(inputs: dict, dtype, model=None) -> dict:
    inputs = {k: v for k, v in inputs.items() if v is not None}
    prepare = getattr(model, "prepare_context", None)
    if prepare is not None:
        return prepare(inputs, dtype)
    return {k: (v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v) for k, v in inputs.items()}


def context_local(model, inputs: dict, dtype, par=vsh.LOCAL) -> dict:
    """A (concrete) model's once-computed context on one device: ``{stack: {name: [layers, ...]}}``
    from the ``CONTEXT`` ``inputs`` (cast to the compute ``dtype``); what :func:`run_local` takes as
    ``context``."""
    consts = model.embed.kv_context(_cast_context(inputs, dtype, model), par)
    out = {}
    for name in getattr(model, "STACKS", ("blocks",)):
        fn = _kv_hook(model, name)
        if fn is not None:
            src = _kv_source(model, name)
            graph, state = nnx.split(getattr(model, src or name))
            kv = _kv_scan(fn, graph, state, consts, par, carried=src is not None)
            out[name] = kv if src is None else kv[1]
    return out


#: the step cache's jitted units per runner signature (vidax.core.stepcache; weights are arguments)
_CACHE_UNITS: dict = {}


def _shapes_key(inputs: dict) -> tuple:
    return tuple(sorted((k, tuple(np.shape(v))) for k, v in inputs.items()))


def run_local(model, inputs: dict, tables: dict, dtype, par=vsh.LOCAL, context: dict | None = None):
    """A (concrete) model's forward on one device, or compiler-partitioned, through the same hooks
    the runner runs per shard: ``prepare`` -> ``embed`` -> every stack (``link_<name>`` first) ->
    ``head`` -> ``finish``. ``inputs``: :meth:`pack`'s arrays (no None); ``tables``: its host tables;
    ``context``: :func:`context_local`'s tree (then ``inputs`` leave out the ``CONTEXT`` names)."""
    from vidax.core import nn

    shapes = tuple(sorted((k, tuple(jnp.shape(v))) for k, v in inputs.items()))
    a = {**inputs, **tables}
    prepare = getattr(model, "prepare", None)
    a = a if prepare is None else prepare(a, dtype)
    carry, consts = model.embed(a, par)
    for i, name in enumerate(getattr(model, "STACKS", ("blocks",))):
        link = getattr(model, f"link_{name}", None)
        if i and link is not None:
            carry = link(carry, consts, par)
        step = getattr(model, "step" if name == "blocks" else f"step_{name}")
        kv = (context or {}).get(name)
        if kv is None:
            carry = nn.scan(getattr(model, name), carry, lambda blk, c, step=step: step(blk, c, consts, par))
        else:
            graph, state = nnx.split(getattr(model, name))
            carry, _ = jax.lax.scan(lambda c, s, step=step: (step(nnx.merge(graph, s[0]), c, {**consts, "kv": s[1]}, par), None),
                                    carry, (state, kv))
    out = model.head(carry, consts, par)
    finish = getattr(model, "finish", None)
    return out if finish is None else finish(out, dict(shapes))


class DiTRunner:
    """``model``: the family's module (abstract or concrete) with the hooks above; ``state``: its
    state (host numpy preferred, or the module). ``mesh``: a Mesh, a spec like ``"tp=2,sp=2"``, or
    None (one device); ``parallelism``: "tp" | "sp" | "tp+sp" | "none" (None: what the mesh
    implies). ``constraints``: model-level divisibility rules (checked before anything is placed).
    ``offload_chunk_size``: None keeps the stacks resident; an int (dividing each stack's layers),
    ``"all"``, or ``{stack: size}`` streams them."""

    def __init__(self, model, state, mesh=None, parallelism: str | None = None, *, constraints=(),
                 offload_chunk_size=None, prefetch: bool = True, attn_impl: str | None = None,
                 track_memory: bool = False, ring: int | None = None):
        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        self.model, self.attn_impl = model, attn_impl
        self.ring = ring if ring is not None else vmesh.ring_degree(mesh)
        self.cfg = getattr(model, "cfg", None)
        self.stack_names = tuple(getattr(model, "STACKS", ("blocks",)))
        # the stacks only a once-computed context runs (KV_FROM sources): placed and streamed alike
        self.all_stacks = self.stack_names + tuple(dict.fromkeys(
            s for n in self.stack_names if (s := _kv_source(model, n)) and s not in self.stack_names))
        self.graphs = {k: nnx.graphdef(getattr(model, k)) for k in ("embed", "head", *self.all_stacks)}
        self.mesh = vmesh.make_mesh(mesh)  # None: a 1x1x1 mesh on the first device
        self.parallelism = vsh.resolve_parallelism(parallelism, self.mesh)
        vmesh.check_divisible(list(constraints), self.mesh, ring=self.ring)
        self.mapping = vsh.axis_rules(self.parallelism, getattr(model, "AXIS_DELTAS", None))
        self.par = vsh.ParallelContext.create(self.mapping, self.mesh, attn_impl=attn_impl, ring=self.ring)
        self.specs = vsh.param_specs(state, self.mapping)
        vsh.check_param_divisibility(state, self.specs, self.mesh)
        self.dtype = np.dtype(jax.tree.leaves(state[self.stack_names[0]])[0].dtype)
        self.rest_specs = self._rest(self.specs)
        self.stack_specs = {n: self.specs[n] for n in self.all_stacks}
        self.rest = vsh.place(self._rest(state), vsh.named_shardings(self.mesh, self.rest_specs))
        shardings = {n: vsh.named_shardings(self.mesh, s) for n, s in self.stack_specs.items()}

        self._tables: dict = {}
        self.cache = None  # a vidax.core.stepcache.StepCache: __call__ runs the cached units (use_cache)
        self._cunits: dict = {}
        self.offload = None
        self.stacks = None
        if offload_chunk_size is None:
            self.stacks = {n: vsh.place(state[n], shardings[n]) for n in self.all_stacks}
            self._fwd = jax.jit(self._forward)
        else:
            parse = getattr(model, "chunk_sizes", None)  # a family's own spec, e.g. "double=4,single=8"
            sizes = parse(offload_chunk_size) if parse is not None else (
                offload_chunk_size if isinstance(offload_chunk_size, dict) else {})
            self.offload = voff.OffloadRunner(prefetch=prefetch, track_memory=track_memory)
            for n in self.all_stacks:
                self.offload.add_stack(n, state[n], self._chunk_fn(n), sizes.get(n, offload_chunk_size), shardings[n])
            for n in self.stack_names:  # a sequential context is streamed in the chunks its stack runs in
                src = _kv_source(model, n)
                if src is not None and self.offload.pools[src].chunk_size != self.offload.pools[n].chunk_size:
                    raise voff.OffloadConfigError(f"offload chunk sizes of {src!r} and {n!r} differ; "
                                                  f"{src!r} computes {n!r}'s keys / values chunk by chunk")
            self._pre = jax.jit(self._prologue)
            self._links = {n: jax.jit(self._link_fn(n)) for n in self.stack_names[1:]
                           if getattr(model, f"link_{n}", None) is not None}
            self._post = jax.jit(self._epilogue, static_argnums=(3, 4))
            self._ctx_pre = jax.jit(self._context_prologue)
            self._ctx_chunks = {n: jax.jit(self._kv_chunk_fn(n)) for n in self.kv_stacks}

    @property
    def kv_stacks(self) -> tuple:
        """The stacks whose blocks' keys / values a once-computed context holds."""
        return tuple(n for n in self.stack_names if _kv_hook(self.model, n) is not None)

    @property
    def context_inputs(self) -> tuple:
        """The inputs :meth:`context` takes (empty: this model computes its K/V every step)."""
        return context_names(self.model) if self.kv_stacks else ()

    def _rest(self, tree) -> nnx.State:
        return nnx.State({k: v for k, v in tree.items() if k not in self.all_stacks})

    def _fwd_stacks(self, tree) -> dict:
        """The stacks the forward runs (not a context's source stacks)."""
        return {n: tree[n] for n in self.stack_names}

    # ------------------------------------------------------------------ specs
    @property
    def block_specs(self):
        """The parameter specs of the (first) block stack."""
        return self.stack_specs[self.stack_names[0]]

    def act_spec(self, name: str, shape) -> P:
        """The mesh layout of activation ``name``: the model's logical names through the table."""
        return vsh.logical_spec(self.model.act_spec(name, tuple(shape)), self.mapping, self.mesh)

    def act_sharding(self, name: str, shape) -> NamedSharding:
        """Where activation ``name`` lives on this runner's mesh (its :meth:`act_spec`)."""
        return NamedSharding(self.mesh, self.act_spec(name, shape))

    def _specs(self, tree):
        return {k: (self._specs(v) if isinstance(v, dict) else P() if k == _VALID else self.act_spec(k, v.shape))
                for k, v in tree.items()}

    # ------------------------------------------------------------------ padded tokens
    def _token_dims(self, tree):
        """``[(leaf, dim)]``: the dimension of each leaf split over ``sp``."""
        specs = self._specs(tree)
        out = []
        for leaf, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec)):
            for d, ax in enumerate(spec):
                if ax == "sp" or (isinstance(ax, tuple) and "sp" in ax):
                    out.append((leaf, d))
        return out

    def token_count(self, tree) -> int | None:
        """The real token count of prepared inputs ``tree`` (arrays or shapes) when it needs padding
        to a multiple of ``sp``; None when it divides (or ``sp`` is 1)."""
        sp = self.mesh.shape["sp"]
        if sp == 1:
            return None
        lens = {leaf.shape[d] for leaf, d in self._token_dims(tree)}
        if all(n % sp == 0 for n in lens):
            return None
        if len(lens) > 1:
            raise vmesh.ShardingConfigError(f"the inputs split over sp have different token counts {sorted(lens)}; "
                                            f"sp={sp} pads one sequence")
        return lens.pop()

    def _pad(self, tree, valid):
        if valid is None:
            return tree
        sp = self.mesh.shape["sp"]
        to = -(-valid // sp) * sp
        dims = {id(leaf): d for leaf, d in self._token_dims(tree)}

        def one(x):
            d = dims.get(id(x))
            if d is None:
                return x
            pad = [(0, 0)] * x.ndim
            pad[d] = (0, to - x.shape[d])
            return jnp.pad(x, pad)
        return jax.tree.map(one, tree)

    def _unpad(self, tree, specs, valid):
        if valid is None:
            return tree

        def one(x, s):
            for d, ax in enumerate(s):
                if ax == "sp" or (isinstance(ax, tuple) and "sp" in ax):
                    return jax.lax.slice_in_dim(x, 0, valid, axis=d)
            return x
        return jax.tree.map(one, tree, specs, is_leaf=lambda x: _is_spec(x) or not isinstance(x, dict))

    @staticmethod
    def _split_valid(consts, par):
        """An offloaded pass's constants without ``__valid__``, and ``par`` for its token count."""
        if _VALID not in consts:
            return consts, par
        consts = dict(consts)
        return consts, par.with_valid(consts.pop(_VALID))

    def context_shardings(self, tree) -> dict:
        """The placement of a context tree (or of its shapes) as :meth:`context` returns it."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._kv_specs(tree), is_leaf=_is_spec)

    def _kv_specs(self, tree):
        """Specs of a context tree ``{stack: {name: [layers, ...]}}``: the layer axis whole, the
        rest by the model's per-layer activation names (e.g. heads split over tp as the weights)."""
        return {n: {k: P(None, *self.act_spec(k, v.shape[1:])) for k, v in t.items()} for n, t in tree.items()}

    def _gathered(self, tree):
        """Specs with the token axis (sp) gathered: what leaves the runner."""
        def one(s):
            return P(*[None if a == "sp" else a for a in s])
        return jax.tree.map(one, tree, is_leaf=_is_spec)

    def _smap(self, fn, in_specs, out_specs):
        return vsh.smap(fn, self.mesh, in_specs, out_specs)

    # ------------------------------------------------------------------ inputs and host tables
    def _pack(self, args, kw) -> tuple[dict, dict]:
        """``(arrays, statics)`` of a call: Python scalars / strings (e.g. a frame rate) are static,
        they select host tables and never enter a program."""
        pack = getattr(self.model, "pack", None)
        inputs = pack(*args, **kw) if pack is not None else (args[0] if args else kw)
        statics = {k: v for k, v in inputs.items() if isinstance(v, _STATIC)} if pack is not None else {}
        return {k: jnp.asarray(v) for k, v in inputs.items() if v is not None and k not in statics}, statics

    def check_inputs(self, inputs: dict) -> None:
        """Input errors before anything compiles: the model's own check, then every sharded input
        dimension against its mesh axes (an error names the input, e.g. the batch against ``dp``)."""
        self.check_shapes({k: tuple(np.shape(v)) for k, v in inputs.items()})

    def check_shapes(self, shapes: dict) -> None:
        """:meth:`check_inputs` from the inputs' shapes (name -> shape) alone."""
        check = getattr(self.model, "check", None)
        if check is not None:
            check(shapes, self.mesh)
        sizes = vmesh.axis_sizes(self.mesh)
        for name, shape in shapes.items():
            for d, ax in enumerate(self.act_spec(name, shape)):
                for a in (ax,) if isinstance(ax, str) else (ax or ()):
                    if a != "sp" and shape[d] % sizes[a]:  # tokens are padded to a multiple of sp
                        what = {"sp": "tokens (sequence parallel)", "dp": "batch", "tp": "width"}.get(a, a)
                        raise vmesh.ShardingConfigError(
                            f"input {name!r} dim {d} (size {shape[d]}, {what}) is not divisible by {a}={sizes[a]}")

    def _host_tables(self, shapes: dict):
        key_fn = getattr(self.model, "table_key", None)
        return (None, None) if key_fn is None else (key_fn(shapes), self.model.tables)

    def _table_spec(self, name, shape) -> P:
        """A host table's placement: its activation spec, the token axis kept whole when ``sp`` does
        not divide it (the program pads it with the tokens)."""
        sp = self.mesh.shape["sp"]
        spec = self.act_spec(name, shape)
        return P(*[None if a == "sp" and shape[d] % sp else a for d, a in enumerate(spec)])

    def tables(self, shapes: dict) -> dict:
        """The model's host tables (e.g. RoPE) for inputs of ``shapes`` (name -> shape), placed with
        their activation specs and cached per key: arguments of the programs, not constants."""
        key, fn = self._host_tables(shapes)
        if fn is None:
            return {}
        if key not in self._tables:
            t = {k: np.asarray(v) for k, v in fn(key).items()}
            self._tables[key] = vsh.place(t, {k: NamedSharding(self.mesh, self._table_spec(k, v.shape)) for k, v in t.items()})
        return self._tables[key]

    # ------------------------------------------------------------------ units, merged inside shard_map
    def _embed(self, rest, inputs, par):
        return nnx.merge(self.graphs["embed"], rest["embed"])(inputs, par)

    def _scan(self, name, blocks, carry, consts, par, kv=None):
        step = getattr(self.model, "step" if name == "blocks" else f"step_{name}")
        graph = self.graphs[name]

        def body(c, s):
            if kv is None:
                return step(nnx.merge(graph, s), c, consts, par), None
            return step(nnx.merge(graph, s[0]), c, {**consts, "kv": s[1]}, par), None  # this layer's K/V

        with vsh.comm_repeat(jax.tree.leaves(blocks)[0].shape[0]):  # traced once, runs once per layer
            out, _ = jax.lax.scan(body, carry, blocks if kv is None else (blocks, kv))
        return out

    def _link(self, name, carry, consts, par):
        fn = getattr(self.model, f"link_{name}", None)
        return carry if fn is None else fn(carry, consts, par)

    def _head(self, rest, carry, consts, par):
        return nnx.merge(self.graphs["head"], rest["head"])(carry, consts, par)

    def _prepared(self, inputs, tables):
        a = {**inputs, **tables}
        prepare = getattr(self.model, "prepare", None)
        return a if prepare is None else prepare(a, self.dtype)

    def _finish(self, out, shapes):
        finish = getattr(self.model, "finish", None)
        return out if finish is None else finish(out, dict(shapes))

    def _gather(self, y, specs):
        return jax.tree.map(lambda a, s: vsh.with_constraint(a, self.mesh, s), y, self._gathered(specs),
                            is_leaf=_is_spec)

    def _embed_shapes(self, rest, a):
        return jax.eval_shape(lambda r, a: self._embed(r, a, vsh.LOCAL), rest, a)

    # ------------------------------------------------------------------ resident
    def _forward(self, rest, stacks, inputs, tables, context=None):
        a = self._prepared(inputs, tables)
        context = context or {}
        valid = self.token_count(a)
        a = self._pad(a, valid)
        par = self.par.with_valid(valid)
        carry_s, consts_s = self._embed_shapes(rest, a)
        for n in self.stack_names[1:]:
            carry_s = jax.eval_shape(lambda c, k, n=n: self._link(n, c, k, vsh.LOCAL), carry_s, consts_s)
        out_s = jax.eval_shape(lambda r, c, k: self._head(r, c, k, vsh.LOCAL), rest, carry_s, consts_s)

        def inner(rest, stacks, a, ctx):
            carry, consts = self._embed(rest, a, par)
            for i, n in enumerate(self.stack_names):
                if i:
                    carry = self._link(n, carry, consts, par)
                carry = self._scan(n, stacks[n], carry, consts, par, ctx.get(n))
            return self._head(rest, carry, consts, par)

        out_specs = self._specs(out_s)
        y = self._smap(inner, (self.rest_specs, self._fwd_stacks(self.stack_specs), self._specs(a),
                               self._kv_specs(context)), out_specs)(rest, self._fwd_stacks(stacks), a, context)
        y = self._unpad(self._gather(y, out_specs), out_specs, valid)
        return self._finish(y, _shapes_key(inputs))

    # ------------------------------------------------------------------ offloaded
    def _prologue(self, rest, inputs, tables):
        a = self._prepared(inputs, tables)
        valid = self.token_count(a)
        a = self._pad(a, valid)
        carry_s, consts_s = self._embed_shapes(rest, a)
        carry, consts = self._smap(lambda r, a: self._embed(r, a, self.par.with_valid(valid)),
                                   (self.rest_specs, self._specs(a)),
                                   (self._specs(carry_s), self._specs(consts_s)))(rest, a)
        if valid is not None:  # the chunks' token count: an argument, so one chunk program serves any count
            consts = {**consts, _VALID: vsh.with_constraint(jnp.int32(valid), self.mesh, P())}
        return carry, consts

    def _chunk_fn(self, name):
        def chunk(blocks, carry, consts, kv=None):
            if kv is None:
                def body(b, c, k):
                    k, par = self._split_valid(k, self.par)
                    return self._scan(name, b, c, k, par)
                return self._smap(body, (self.stack_specs[name], self._specs(carry), self._specs(consts)),
                                  self._specs(carry))(blocks, carry, consts)
            kv = {name: kv}

            def body_kv(b, c, k, x):
                k, par = self._split_valid(k, self.par)
                return self._scan(name, b, c, k, par, x[name])
            return self._smap(body_kv, (self.stack_specs[name], self._specs(carry), self._specs(consts), self._kv_specs(kv)),
                              self._specs(carry))(blocks, carry, consts, kv)
        return chunk

    # ------------------------------------------------------------------ text K/V once
    def _context_consts(self, rest, a, par):
        return nnx.merge(self.graphs["embed"], rest["embed"]).kv_context(a, par)

    def _src(self, name) -> str:
        """The stack whose weights compute stack ``name``'s K/V (itself unless ``KV_FROM`` says)."""
        return _kv_source(self.model, name) or name

    def _kv_local(self, name, blocks, consts, par, carried_out: bool = False):
        """Stack ``name``'s K/V over the layers of ``blocks`` (its source stack's); ``carried_out``:
        ``(consts, kv)`` of a sequential context (the constants the next chunk starts from)."""
        src = _kv_source(self.model, name)
        out = _kv_scan(_kv_hook(self.model, name), self.graphs[self._src(name)], blocks, consts, par,
                       carried=src is not None)
        return out if src is None or carried_out else out[1]

    def _context_forward(self, rest, stacks, inputs):
        a = _cast_context(inputs, self.dtype, self.model)
        consts_s = jax.eval_shape(lambda r, a: self._context_consts(r, a, vsh.LOCAL), rest, a)
        srcs = {self._src(n): self.stack_specs[self._src(n)] for n in self.kv_stacks}
        out_s = jax.eval_shape(lambda s, k: {n: self._kv_local(n, s[self._src(n)], k, vsh.LOCAL) for n in self.kv_stacks},
                               stacks, consts_s)

        def inner(rest, stacks, a):
            consts = self._context_consts(rest, a, self.par)
            return {n: self._kv_local(n, stacks[self._src(n)], consts, self.par) for n in self.kv_stacks}

        return self._smap(inner, (self.rest_specs, srcs, self._specs(a)),
                          self._kv_specs(out_s))(rest, {n: stacks[n] for n in srcs}, a)

    def _context_prologue(self, rest, inputs):
        a = _cast_context(inputs, self.dtype, self.model)
        consts_s = jax.eval_shape(lambda r, a: self._context_consts(r, a, vsh.LOCAL), rest, a)
        return self._smap(lambda r, a: self._context_consts(r, a, self.par), (self.rest_specs, self._specs(a)),
                          self._specs(consts_s))(rest, a)

    def _kv_chunk_fn(self, name):
        src, carried = self._src(name), _kv_source(self.model, name) is not None

        def chunk(blocks, consts):
            out_s = jax.eval_shape(lambda b, k: self._kv_local(name, b, k, vsh.LOCAL, carried), blocks, consts)
            out_specs = ((self._specs(out_s[0]), self._kv_specs({name: out_s[1]})[name]) if carried
                         else self._kv_specs({name: out_s})[name])
            return self._smap(lambda b, k: self._kv_local(name, b, k, self.par, carried),
                              (self.stack_specs[src], self._specs(consts)), out_specs)(blocks, consts)
        return chunk

    def context(self, inputs: dict) -> dict:
        """The blocks' text keys / values from the ``CONTEXT`` ``inputs`` (e.g. ``{"ctx": [B, Lt,
        D]}``, the batch as the steps will run it), computed once: pass it to every step's call
        (``context=``) in place of those inputs. Resident: one program (``{stack: [layers, ...]}``);
        offloaded: the blocks streamed once, a list of per-chunk trees per stack."""
        inputs = {k: jnp.asarray(v) for k, v in inputs.items() if v is not None}
        if self.offload is None:
            return _context_program(self)(self.params, inputs)
        consts = self._ctx_pre(self.rest, inputs)
        return {n: self.offload.map(self._src(n), self._ctx_chunks[n], consts, carry=_kv_source(self.model, n) is not None)
                for n in self.kv_stacks}

    def context_apply(self, params, inputs: dict) -> dict:
        """Traceable :meth:`context` of the resident runner (``params``: :attr:`params` or
        :meth:`step_params`)."""
        inputs = {k: jnp.asarray(v) for k, v in inputs.items() if v is not None}
        return self._context_forward(params["rest"], {n: params[n] for n in self.all_stacks}, inputs)

    def _link_fn(self, name):
        def link(carry, consts):
            local, _ = self._split_valid(consts, vsh.LOCAL)
            out_s = jax.eval_shape(lambda c, k: self._link(name, c, k, vsh.LOCAL), carry, local)

            def body(c, k):
                k, par = self._split_valid(k, self.par)
                return self._link(name, c, k, par)
            return self._smap(body, (self._specs(carry), self._specs(consts)), self._specs(out_s))(carry, consts)
        return link

    def _epilogue(self, rest, carry, consts, shapes, valid):
        consts = {k: v for k, v in consts.items() if k != _VALID}
        par = self.par.with_valid(valid)
        out_s = jax.eval_shape(lambda r, c, k: self._head(r, c, k, vsh.LOCAL), rest, carry, consts)
        out_specs = self._specs(out_s)
        y = self._smap(lambda r, c, k: self._head(r, c, k, par),
                       (self.rest_specs, self._specs(carry), self._specs(consts)), out_specs)(rest, carry, consts)
        return self._finish(self._unpad(self._gather(y, out_specs), out_specs, valid), shapes)

    # ------------------------------------------------------------------ call
    def _without_context(self, inputs: dict, context) -> dict:
        return inputs if context is None else {k: v for k, v in inputs.items() if k not in context_names(self.model)}

    def __call__(self, *args, context=None, **kw):
        """The model's call (``pack``'s signature; default one inputs dict), weights resident or
        streamed; ``context``: :meth:`context`'s tree (the ``CONTEXT`` inputs are then not read)."""
        inputs, statics = self._pack(args, kw)
        inputs = self._without_context(inputs, context)
        self.check_inputs(inputs)
        tables = self.tables({**{k: tuple(v.shape) for k, v in inputs.items()}, **statics})
        if self.cache is not None:
            return self._cached_call(inputs, tables, context)
        if self.offload is None:
            return self._fwd(self.rest, self.stacks, inputs, tables, context)
        valid = self.token_count(jax.eval_shape(self._prepared, inputs, tables))
        carry, consts = self._pre(self.rest, inputs, tables)
        for i, n in enumerate(self.stack_names):
            if i and n in self._links:
                carry = self._links[n](carry, consts)
            kv = (context or {}).get(n)
            carry = self.offload.run(n, carry, consts, per_chunk=kv)
        return self._post(self.rest, carry, consts, _shapes_key(inputs), valid)

    # ------------------------------------------------------------------ step caching (vidax.core.stepcache)
    def use_cache(self, cache) -> "DiTRunner":
        """Run every later call through the step cache ``cache`` (a :class:`~vidax.core.stepcache.StepCache`;
        None: plain calls again). The decisions are taken on the host between jitted units: embed
        (+ the first block), the remaining blocks, the cached-residual shortcut, the head."""
        if cache is not None and self.offload is not None:
            raise ValueError("step caching does not run with weight offloading (--offload-chunk-size) yet")
        self.cache = cache
        return self

    def _metric_key(self, carry) -> str:
        """The carry entry whose residual the cache measures: the video tokens (``CACHE_KEY``)."""
        key = getattr(self.model, "CACHE_KEY", None)
        if key is None:
            key = next((k for k in ("h", "vid", "x") if k in carry), None)
        if key is None:
            key = next(k for k in sorted(carry) if jnp.ndim(carry[k]) >= 2)
        return key

    def _scan_range(self, name, blocks, carry, consts, par, lo: int, hi: int, kv=None):
        """Blocks ``lo..hi-1`` of stack ``name`` (the stacked weights indexed in the loop: no copy);
        ``kv``: the stack's once-computed text keys / values (each layer's slice to its block)."""
        step = getattr(self.model, "step" if name == "blocks" else f"step_{name}")
        graph = self.graphs[name]

        if (lo, hi) == (0, jax.tree.leaves(blocks)[0].shape[0]):  # the whole stack: as the plain forward runs it
            return self._scan(name, blocks, carry, consts, par, kv)

        def body(c, i):
            at = lambda t: jax.tree.map(lambda s: jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False), t)  # noqa: E731
            k = consts if kv is None else {**consts, "kv": at(kv)}
            return step(nnx.merge(graph, at(blocks)), c, k, par), None

        out, _ = jax.lax.scan(body, carry, jnp.arange(lo, hi))
        return out

    def _links_all(self, carry, consts, par):
        for n in self.stack_names[1:]:
            carry = self._link(n, carry, consts, par)
        return carry

    def _cache_unit(self, name):
        """The cached forward's jitted units: built once per :attr:`signature` (on a weightless
        :meth:`program` copy; the weights are arguments) and shared by later runners of the same
        model, mesh and dtype (a batch's next prompt, a resumed run): one program per shape."""
        if name in self._cunits:
            return self._cunits[name]
        key = self.signature
        if key not in _CACHE_UNITS:
            while len(_CACHE_UNITS) >= 8:
                _CACHE_UNITS.pop(next(iter(_CACHE_UNITS)))
            _CACHE_UNITS[key] = self.program()._build_cache_units()
        self._cunits.update(_CACHE_UNITS[key])
        return self._cunits[name]

    def _build_cache_units(self) -> dict:
        first_stack = self.stack_names[0]

        def embed_first(rest, stacks, inputs, tables, n_first, ctx, signal=False):
            """The embedding (+ the first ``n_first`` blocks) and the first block's residual of the
            metric key (``signal``: instead, the model's ``teacache_input`` from the first block)."""
            a = self._prepared(inputs, tables)
            carry_s, consts_s = self._embed_shapes(rest, a)
            key = self._metric_key(carry_s)

            def inner(rest, stacks, a, ctx):
                carry, consts = self._embed(rest, a, self.par)
                if signal:  # the same shape as the metric key's tokens
                    first = jax.tree.map(lambda s: jax.lax.index_in_dim(s, 0, 0, keepdims=False), stacks[first_stack])
                    sig = self.model.teacache_input(nnx.merge(self.graphs[first_stack], first), carry, consts,
                                                    self.par)
                    return carry, consts, sig.astype(carry[key].dtype)
                c1 = carry if not n_first else self._scan_range(first_stack, stacks[first_stack], carry, consts,
                                                                self.par, 0, n_first, ctx.get(first_stack))
                return c1, consts, c1[key] - carry[key]

            specs = (self._specs(carry_s), self._specs(consts_s), self.act_spec(key, carry_s[key].shape))
            return self._smap(inner, (self.rest_specs, self._fwd_stacks(self.stack_specs), self._specs(a), self._kv_specs(ctx)),
                              specs)(rest, stacks, a, ctx)

        def blocks_rest(stacks, c1, consts, n_first, ctx):
            """The remaining blocks, and the carry they start from carried through the links (``base``)."""
            n_layers = jax.tree.leaves(stacks[first_stack])[0].shape[0]
            base_s = jax.eval_shape(lambda c, k: self._links_all(c, k, vsh.LOCAL), c1, consts)

            def inner(stacks, c1, consts, ctx):
                c = self._scan_range(first_stack, stacks[first_stack], c1, consts, self.par, n_first, n_layers,
                                     ctx.get(first_stack))
                for n in self.stack_names[1:]:
                    c = self._link(n, c, consts, self.par)
                    c = self._scan(n, stacks[n], c, consts, self.par, ctx.get(n))
                return c, self._links_all(c1, consts, self.par)

            spec = self._specs(base_s)
            final, base = self._smap(inner, (self._fwd_stacks(self.stack_specs), self._specs(c1), self._specs(consts),
                                             self._kv_specs(ctx)), (spec, spec))(stacks, c1, consts, ctx)
            return final, jax.tree.map(lambda f, b: f - b, final, base)

        def shortcut(c1, consts, tail):
            base_s = jax.eval_shape(lambda c, k: self._links_all(c, k, vsh.LOCAL), c1, consts)
            base = self._smap(lambda c, k: self._links_all(c, k, self.par), (self._specs(c1), self._specs(consts)),
                              self._specs(base_s))(c1, consts)
            return jax.tree.map(lambda b, t: b + t.astype(b.dtype), base, tail)

        def merge(new, old, rows):
            """Per batch row: ``new`` where computed, ``old`` elsewhere (leaves without the batch axis: new)."""
            def one(n, o):
                if n.ndim == 0 or n.shape[0] != rows.shape[0]:
                    return n
                return jnp.where(rows.reshape((-1,) + (1,) * (n.ndim - 1)), n, o.astype(n.dtype))
            return jax.tree.map(one, new, old)

        return {"embed_first": jax.jit(embed_first, static_argnums=(4, 6)), "rest": jax.jit(blocks_rest, static_argnums=3),
                "shortcut": jax.jit(shortcut), "merge": jax.jit(merge),
                "head": jax.jit(lambda rest, carry, consts, shapes: self._epilogue(rest, carry, consts, shapes, None),
                                static_argnums=(3,))}

    def _place_like(self, tree: dict) -> dict:
        """Carry-like arrays placed with their activation layout (a no-op when they already are)."""
        return {k: jax.device_put(v, self.act_sharding(k, np.shape(v))) for k, v in tree.items()}

    def _cached_call(self, inputs, tables, context=None):
        """One cached forward (``self.cache`` decides per CFG branch; see vidax.core.stepcache);
        ``context``: the once-computed text keys / values (:meth:`context`), or None."""
        from vidax.core.stepcache import rows_mask

        cache, u = self.cache, self._cache_unit
        if self.token_count(jax.eval_shape(self._prepared, inputs, tables)) is not None:
            raise vmesh.ShardingConfigError(f"step caching needs a token count that sp={self.mesh.shape['sp']} divides "
                                            f"(a padded sequence-parallel run is not cached yet); use another sp or "
                                            f"--cache none")
        n_first = 1 if cache.method == "fbcache" else 0
        # the inputs laid out as the programs take them (whichever program made them): one compile each
        inputs = {k: jax.device_put(v, self.act_sharding(k, v.shape)) for k, v in inputs.items()}
        ctx = context or {}
        signal = cache.method == "teacache" and hasattr(self.model, "teacache_input")
        c1, consts, r = u("embed_first")(self.rest, self._fwd_stacks(self.stacks), inputs, tables, n_first, ctx,
                                         signal)
        key = self._metric_key(c1)
        batch = c1[key].shape[0]
        if cache.tail is not None:  # e.g. restored from a step checkpoint (host arrays)
            cache.tail = self._place_like(cache.tail)
        if cache.prev is not None:
            cache.prev = self._place_like({key: cache.prev})[key]
        if cache.method == "taylorseer":
            return self._taylor_call(inputs, c1, consts, ctx)
        if cache.method == "teacache":
            name = key if signal else getattr(self.model, "TEACACHE_INPUT", None)
            if name is None:
                raise ValueError(f"teacache: {type(self.model).__name__} declares no modulated input (TEACACHE_INPUT)")
            if cache.mod_prev is not None:
                cache.mod_prev = self._place_like({name: cache.mod_prev})[name]
            compute = cache.decide_modulated(r if signal else consts[name])
        else:
            compute = cache.decide_first_block(r) if cache.method == "fbcache" else cache.decide_magnitude()
        rows = rows_mask(compute, batch)
        if compute.all() or (not compute.any() and cache.tail is None):
            final, tail = u("rest")(self._fwd_stacks(self.stacks), c1, consts, n_first, ctx)
            prev = r
        elif not compute.any():
            final, tail, prev = u("shortcut")(c1, consts, cache.tail), None, None
        else:  # mixed: the whole batch runs, the skipped branches take the cached residual
            full, tail_new = u("rest")(self._fwd_stacks(self.stacks), c1, consts, n_first, ctx)
            old = {"final": u("shortcut")(c1, consts, cache.tail), "tail": cache.tail,
                   "prev": r if cache.prev is None else cache.prev}
            m = u("merge")({"final": full, "tail": tail_new, "prev": r}, old, jnp.asarray(rows))
            final, tail, prev = m["final"], m["tail"], m["prev"]
        # the cache's arrays laid out alike whichever unit made them (or a checkpoint): one compile per unit
        tail = None if tail is None else self._place_like(tail)
        prev = None if prev is None else self._place_like({key: prev})[key]
        cache.record(compute, prev=prev if n_first else None, tail=tail,
                     residual=None if tail is None else tail[key])
        return u("head")(self.rest, final, consts, _shapes_key(inputs))

    def _taylor_call(self, inputs, c1, consts, ctx):
        """taylorseer: the blocks on the schedule's steps (their output features update the Taylor
        factors), the extrapolated features on the others; the head every step."""
        cache, u = self.cache, self._cache_unit
        compute = cache.decide_schedule()
        if compute.all():
            final, _ = u("rest")(self._fwd_stacks(self.stacks), c1, consts, 0, ctx)
            cache.taylor_update(final)
        elif not compute.any():
            if cache.taylor and not isinstance(jax.tree.leaves(cache.taylor)[0], jax.Array):  # from a checkpoint
                cache.taylor = tuple(self._place_like(t) for t in cache.taylor)
            shapes = jax.eval_shape(lambda c, k: self._links_all(c, k, vsh.LOCAL), c1, consts)
            final = {k: v.astype(shapes[k].dtype) for k, v in cache.taylor_predict().items()}
        else:  # the branches share one schedule; only an expert's start resets them, all together
            raise ValueError(f"taylorseer: the CFG branches disagree on the schedule ({compute.tolist()})")
        cache.record(compute)
        return u("head")(self.rest, final, consts, _shapes_key(inputs))

    @property
    def params(self):
        """The placed state (resident runner), ``{"rest", <stack>...}``: pass it to :meth:`apply`."""
        if self.offload is not None:
            raise ValueError("an offloading runner streams its blocks; call the runner, not apply()")
        return {"rest": self.rest, **self.stacks}  # with a context's source stacks

    def step_params(self, shapes: dict) -> dict:
        """:attr:`params` plus the host tables of inputs of ``shapes`` (name -> shape, and any static
        such as ``fps``): what a jitted
        sampling step passes to :meth:`apply`, so the tables are arguments of the program."""
        return {**self.params, "tables": self.tables(shapes)}

    def apply(self, params, *args, context=None, **kw):
        """Traceable forward (params stay arguments) for a jitted sampling step; without
        ``params["tables"]`` the host tables are computed into the program; ``context``: the tree of
        :meth:`context_apply` (the ``CONTEXT`` inputs are then not read)."""
        inputs, statics = self._pack(args, kw)
        inputs = self._without_context(inputs, context)
        self.check_inputs(inputs)
        tables = params.get("tables")
        if tables is None:
            key, fn = self._host_tables({**{k: tuple(v.shape) for k, v in inputs.items()}, **statics})
            tables = {} if fn is None else {k: jnp.asarray(v) for k, v in fn(key).items()}
        return self._forward(params["rest"], {n: params[n] for n in self.stack_names}, inputs, tables, context)

    def lower(self, *args, **kw):
        """``jax.jit(...).lower`` of the resident forward (for ``compile().memory_analysis()``)."""
        inputs, statics = self._pack(args, kw)
        self.check_inputs(inputs)
        return self._fwd.lower(self.rest, self.stacks, inputs,
                               self.tables({**{k: tuple(v.shape) for k, v in inputs.items()}, **statics}))

    def program(self) -> "DiTRunner":
        """A copy of this runner without its weights: what :meth:`apply` needs (model, mesh, specs),
        safe to keep in a cache of compiled steps after the weights are dropped."""
        spec = copy.copy(self)
        spec.rest = spec.stacks = spec.offload = None
        spec._fwd = spec._pre = spec._post = None  # jitted methods bound to this runner (and its weights)
        spec._links, spec._tables, spec._cunits, spec.cache = {}, {}, {}, None
        spec._ctx_pre, spec._ctx_chunks = None, {}
        return spec

    @property
    def signature(self) -> tuple:
        """What :meth:`apply`'s program depends on besides its inputs: equal signatures, one program."""
        return (type(self.model).__name__, self.cfg, self.dtype.name, self.parallelism, tuple(self.mesh.shape.items()),
                tuple(int(d.id) for d in self.mesh.devices.flat), self.attn_impl, self.ring)


#: the jitted context programs, by runner signature (shared by later prompts and the other expert)
_CONTEXTS: dict = {}


def _context_program(runner: DiTRunner):
    key = runner.signature
    if key not in _CONTEXTS:
        if len(_CONTEXTS) >= 16:
            _CONTEXTS.pop(next(iter(_CONTEXTS)))
        _CONTEXTS[key] = jax.jit(runner.program().context_apply)
    return _CONTEXTS[key]


__all__ = ["DiTRunner", "TEXT_KV_ONCE", "context_local", "context_names", "run_local"]
