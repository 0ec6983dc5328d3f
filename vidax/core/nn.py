"""Flax NNX building blocks and conventions shared by every model in vidax.

- Models are ``nnx.Module``s; repeated blocks are built with :func:`stack` (parameters stacked on
  a leading :data:`LAYERS` axis) and run with :func:`scan` / :func:`scan_range`.
- Parameters carry logical axis names (:func:`logical`, ``Linear(axes=...)``); a table per
  parallelism maps them to mesh axes (``vidax.core.sharding``).
- A loaded model is split once (:class:`Split`: graphdef + state, one jitted pure function).
- Real checkpoints fill an abstract state (:func:`abstract_state`, :func:`fill`); presets and
  tests draw seeded weights with :func:`perturb`.
- Norms with the PyTorch references' numerics: :func:`LayerNorm`, :class:`RMSNorm`.
- Activations by the names reference configs use (:data:`ACTIVATIONS`).
"""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core import conv as vconv
from vidax.core import geometry


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {
    "gelu": gelu_exact,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu-approximate": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


# ---------------------------------------------------------------------------------------------
# Flax NNX conventions (every model in vidax is an nnx.Module; see the README's architecture)
# ---------------------------------------------------------------------------------------------
from typing import Callable  # noqa: E402

from flax import nnx  # noqa: E402

# Parameters carry *logical* axis names as metadata; vidax places them itself (vidax.core.sharding
# maps logical names to mesh axes per parallelism), so variables are never sharded on creation:
# globally (the flag every thread reads: Prefect runs tasks in worker threads) and for this thread.
import flax  # noqa: E402

flax.config.update("flax_always_shard_variable", False)
nnx.use_eager_sharding(False)

#: the leading axis of stacked (scanned / offloaded) blocks
LAYERS = "layers"


def logical(init, *axes):
    """An initializer whose parameter carries logical axis names (``None``: never sharded)."""
    return nnx.with_partitioning(init, tuple(axes))


def Linear(din: int, dout: int, *, rngs: nnx.Rngs, axes=(None, None), bias: bool = True,
           param_dtype=jnp.float32, precision=None) -> nnx.Linear:
    """``nnx.Linear`` (kernel ``[in, out]``) with logical axes ``axes`` on the kernel and
    ``axes[1]`` on the bias, computing in the input's dtype. ``precision``: None is the backend's
    default (full float32 on CPU; bf16 passes for float32 on TPU, TF32 on recent GPUs), which the
    DiTs use; the prompt encoders pass ``HIGHEST`` so a float32 encode is float32 everywhere."""
    return nnx.Linear(din, dout, use_bias=bias, rngs=rngs, param_dtype=param_dtype, precision=precision,
                      kernel_init=logical(nnx.initializers.lecun_normal(), *axes),
                      bias_init=logical(nnx.initializers.zeros_init(), axes[1]))


def stack(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """``n`` blocks as one module whose parameters are stacked on a leading :data:`LAYERS` axis
    (``nnx.vmap``); run them with :func:`scan`, stream slices of their state to offload."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def build(r):
        return make(r)

    return build(rngs)


def scan(blocks: nnx.Module | tuple, carry, body: Callable):
    """``lax.scan`` over stacked blocks: ``body(block, carry) -> carry`` sees one merged block per
    step. ``blocks``: the stacked module, or ``(graphdef, state)`` of it or of a slice of it (an
    offload chunk: ``jax.tree.map(lambda a: a[i:j], state)``)."""
    graphdef, state = nnx.split(blocks) if isinstance(blocks, nnx.Module) else blocks

    def step(c, s):
        return body(nnx.merge(graphdef, s), c), None

    out, _ = jax.lax.scan(step, carry, state)
    return out


def perturb(module: nnx.Module, seed: int = 0, scale: float = 1.0) -> nnx.Module:
    """Seeded random weights for presets and tests, in place: every parameter is moved off its
    initial value (zero biases become small noise, unit norm weights 1 +- noise), so no bug hides
    behind a zero or a one."""
    rng = np.random.default_rng(seed)
    for _, v in sorted(nnx.iter_graph(module), key=lambda kv: str(kv[0])):
        if isinstance(v, nnx.Param):
            a = np.asarray(v[...], np.float32)
            if not np.any(a):
                a = 0.02 * scale * rng.standard_normal(a.shape)
            elif np.all(a == 1):
                a = 1 + 0.05 * scale * rng.standard_normal(a.shape)
            v[...] = jnp.asarray(a, v[...].dtype)
    return module


def _is_value(v) -> bool:
    """Whether ``v`` fixes what a builder closing over it builds, by value: plain values, dtypes,
    frozen dataclasses (the configs), functions / classes / modules (their code), and tuples of them."""
    import dataclasses as dc
    import types

    if v is None or isinstance(v, (bool, int, float, str, np.dtype, type, types.FunctionType, types.BuiltinFunctionType,
                                   types.ModuleType, ModelKit)):
        return True
    if isinstance(v, tuple):
        return all(_is_value(x) for x in v)
    return dc.is_dataclass(v) and not isinstance(v, type) and v.__dataclass_params__.frozen


def _build_key(build):
    """A hashable key for a builder whose result depends only on its code and the values it closes
    over (a lambda / function whose defaults and closure cells are :func:`_is_value`, or a
    ``functools.partial`` of such a function); None when that cannot be told."""
    import functools as ft
    import types

    try:
        if isinstance(build, types.MethodType):  # a bound method: its function and its object
            inner = _build_key(build.__func__)
            vals, key = (build.__self__,), (inner, build.__self__)
        elif isinstance(build, ft.partial):
            inner = _build_key(build.func)
            vals = (*build.args, *build.keywords.values())
            key = (inner, build.args, tuple(sorted(build.keywords.items())))
        else:
            vals = (*(build.__defaults__ or ()), *(build.__kwdefaults__ or {}).values(),
                    *(c.cell_contents for c in build.__closure__ or ()))
            inner, key = True, (build.__code__, build.__defaults__, tuple(vals))
        if inner is None or not all(_is_value(v) for v in vals):
            return None
        hash(key)
        return key
    except (AttributeError, TypeError, ValueError):  # a callable object, an empty cell, an unhashable value
        return None


#: abstract modules by builder (:func:`_build_key`): tracing a module's construction costs 0.1-0.5 s
#: (every parameter's initialiser and RNG split, traced), and a process builds the same module's
#: abstract state several times (key-map shapes, the state to fill, graph definitions)
_ABSTRACT: dict = {}


class _NoTracerOrigins:
    """While a module's construction is traced, Flax NNX compares each updated variable's
    ``sharding`` with its old one (its RNG counters: every parameter's initialiser bumps one); on a
    tracer that attribute raises, and JAX builds the error's message by walking the whole jaxpr
    traced so far for the value's origin (``_origin_msg``): quadratic in the module's size, and the
    message is thrown away (``getattr(..., None)``). This context skips that walk (halves the trace
    of a tiny Wan VAE: 0.62 s -> 0.32 s); if JAX no longer has the method, it does nothing. Nested
    and concurrent uses (a batch's threads) count themselves: the last one out restores JAX's."""

    _lock = threading.Lock()
    _depth = 0
    _orig = None

    def __enter__(self):
        from jax._src.interpreters import partial_eval as pe

        cls = getattr(pe, "DynamicJaxprTracer", None)
        with self._lock:
            if type(self)._depth == 0 and hasattr(cls, "_origin_msg"):
                type(self)._orig = (cls, cls.__dict__.get("_origin_msg"))
                cls._origin_msg = lambda tracer: ""
            type(self)._depth += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            type(self)._depth -= 1
            if type(self)._depth == 0 and type(self)._orig is not None:
                cls, orig = type(self)._orig
                if orig is None:
                    del cls._origin_msg  # it was inherited: JAX's own again
                else:
                    cls._origin_msg = orig
                type(self)._orig = None
        return False


def _eval_shape(build):
    with _NoTracerOrigins():
        return nnx.eval_shape(build)


def abstract_module(build: Callable[[], nnx.Module]) -> nnx.Module:
    """The module ``build()`` makes, with ``jax.ShapeDtypeStruct`` leaves, traced once per builder
    (:func:`_build_key`) and shared: read it (its structure, shapes, graph definition), never change it."""
    key = _build_key(build)
    if key is None:
        return _eval_shape(build)
    if key not in _ABSTRACT:
        _ABSTRACT[key] = _eval_shape(build)
    return _ABSTRACT[key]


def abstract_state(build: Callable[[], nnx.Module]):
    """``(graphdef, state)`` of a module with ``jax.ShapeDtypeStruct`` leaves: what a checkpoint
    must fill, without allocating a single weight. The state is the caller's own (fresh variables:
    filling it leaves the cached abstract module as it was)."""
    graphdef, state = nnx.split(abstract_module(build))
    return graphdef, jax.tree.map(lambda x: x, state)


def shapes(build: Callable[[], nnx.Module]) -> dict:
    """The module's parameter shapes as a pure nested dict (the target of key maps)."""
    return nnx.to_pure_dict(abstract_state(build)[1])


def fill(state, pure: dict):
    """``state`` (abstract or not) with every leaf replaced from the nested dict ``pure`` (host
    numpy, as the key maps produce it), in place; returns it."""
    nnx.replace_by_pure_dict(state, pure)
    return state


# Norms and embeddings with the references' numerics, in-place layer ranges, and the split-once
# call path every loaded model uses (``Split``: graphdef + state, one jitted pure function).
import dataclasses  # noqa: E402
import functools  # noqa: E402
from typing import Any  # noqa: E402


def Embed(num: int, dim: int, *, rngs: nnx.Rngs, axes=("vocab", "embed"), std: float = 1.0,
          param_dtype=jnp.float32) -> nnx.Embed:
    """``nnx.Embed`` (table ``[num, dim]``, ``normal(std)`` init). A lookup returns the table's own
    dtype: callers cast the gathered rows, never the whole (vocabulary-sized) table."""
    return nnx.Embed(num, dim, param_dtype=param_dtype, rngs=rngs,
                     embedding_init=logical(nnx.initializers.normal(std), *axes))


def scan_range(blocks: nnx.Module | tuple, carry, body: Callable, start: int = 0, stop: int | None = None,
               collect: bool = False):
    """:func:`scan` over layers ``start .. stop-1`` of stacked ``blocks``, each layer indexed in
    place (no copy of a slice of the stack). Returns ``(carry, per-layer carries [stop-start, ...])``
    with ``collect``, else ``(carry, None)``."""
    graphdef, state = nnx.split(blocks) if isinstance(blocks, nnx.Module) else blocks
    stop = jax.tree.leaves(state)[0].shape[0] if stop is None else stop

    def step(c, i):
        layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), state)
        c = body(nnx.merge(graphdef, layer), c)
        return c, (c if collect else None)

    return jax.lax.scan(step, carry, jnp.arange(start, stop, dtype=jnp.int32))


class _Graph:
    """A graphdef as a jit static argument with its hash computed once (hashing a graphdef walks
    every node: tens of microseconds per call otherwise); equal graphs compare equal."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef, self._hash = graphdef, hash(graphdef)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _Graph) and (self is other or self.graphdef == other.graphdef)


def _apply_pure(graph: _Graph, method: str, static: tuple, state, *args):
    return getattr(nnx.merge(graph.graphdef, state), method)(*args, **dict(static))


_apply = jax.jit(_apply_pure, static_argnums=(0, 1, 2))
#: the same for a model of convolutions (a VAE): compiled with the conv programs' options
_apply_conv = vconv.jit(_apply_pure, static_argnums=(0, 1, 2))


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """A module split once (``nnx.split``): ``graphdef`` (static) + ``state`` (the pytree loaders
    fill, shardings place, offloading streams) + its ``cfg``.

    Calls run one jitted pure function of the state that merges the module inside the trace:
    one compile per (graph, method, keyword options, input shapes and dtypes), shared by every
    ``Split`` with an equal graph. Positional arguments are arrays (or ``None``); keyword
    arguments are static Python values. ``conv``: its programs are convolutions (a VAE's), compiled
    through :func:`vidax.core.conv.jit` (:func:`vidax.core.conv.conv_model` sets it)."""

    graphdef: Any
    state: Any
    cfg: Any = None
    conv: bool = False
    _graph: _Graph = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_graph", _Graph(self.graphdef))

    @classmethod
    def of(cls, module: nnx.Module):
        """Split a built module (its ``cfg`` attribute, if any, is kept)."""
        return cls(*nnx.split(module), getattr(module, "cfg", None))

    @classmethod
    def from_pure(cls, build: Callable[[], nnx.Module], pure: dict, device_put: bool = True):
        """``build()``'s split with every weight taken from the nested dict ``pure`` (host numpy,
        as the key maps produce it). ``build`` runs abstractly: no random init is materialised."""
        graphdef, state = abstract_state(build)
        leaves = lambda tree: {jax.tree_util.keystr(p): tuple(np.shape(a))  # noqa: E731
                               for p, a in jax.tree_util.tree_leaves_with_path(tree)}
        want, got = leaves(nnx.to_pure_dict(state)), leaves(pure)
        bad = sorted(want.keys() ^ got.keys()) + [f"{k} {got[k]} (expected {want[k]})"
                                                  for k in sorted(want.keys() & got.keys()) if got[k] != want[k]]
        if bad:
            raise ValueError(f"weights do not fit the module: {bad[:5]}" + (" ..." if len(bad) > 5 else ""))
        cfg = getattr(nnx.merge(graphdef, state), "cfg", None)
        fill(state, pure)
        return cls(graphdef, jax.device_put(state) if device_put else state, cfg)

    def apply(self, method: str, *args, **static):
        """``module.<method>(*args, **static)`` through the jitted pure function."""
        return self._program(self._graph, method, tuple(sorted(static.items())), self.state, *args)

    @property
    def _program(self):
        return _apply_conv if self.conv else _apply

    def method_fn(self, method: str, **static):
        """``module.<method>(**static)`` as the jitted pure function of ``(state, *args)`` that
        :meth:`apply` calls (for ``jax.eval_shape``, ``vidax plan``)."""
        return functools.partial(self._program, self._graph, method, tuple(sorted(static.items())))

    def __call__(self, *args, **static):
        return self.apply("__call__", *args, **static)

    def merge(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state)

    def replace(self, **changes):
        """A copy with some fields replaced (e.g. ``state=`` placed with shardings)."""
        return dataclasses.replace(self, **changes)


def param(rngs: nnx.Rngs, init, shape, *axes, dtype=jnp.float32) -> nnx.Param:
    """A parameter of ``shape`` drawn from ``init`` with one logical axis name per dim."""
    if len(axes) != len(shape):
        raise ValueError(f"param of shape {tuple(shape)} needs {len(shape)} logical axes, got {axes}")
    return nnx.Param(logical(init, *axes)(rngs.params(), tuple(shape), dtype))


def LayerNorm(dim: int, *, rngs: nnx.Rngs, eps: float = 1e-5, affine: bool = True, axis: str | None = None,
              param_dtype=jnp.float32) -> nnx.LayerNorm:
    """``nnx.LayerNorm`` with the PyTorch references' numerics: two-pass variance
    (``use_fast_variance=False``), statistics and output in float32 (callers cast back); the
    optional affine parameters carry the logical ``axis``."""
    return nnx.LayerNorm(dim, epsilon=eps, use_scale=affine, use_bias=affine, use_fast_variance=False,
                         dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
                         scale_init=logical(nnx.initializers.ones_init(), axis),
                         bias_init=logical(nnx.initializers.zeros_init(), axis))


class RMSNorm(nnx.Module):
    """RMS norm over the last axis (T5 / Llama / Wan's q-k norm: no mean subtraction) with float32
    statistics and a learned ``scale`` (``[dim]``, logical axis ``axis``).

    The feature dim may be split across devices: Wan's q/k norm spans every attention head, so
    under tensor parallelism its input and ``scale`` are split with the heads. Inside
    ``shard_map``, ``par`` (a :class:`vidax.core.sharding.ParallelContext`) reads that from the
    scale's metadata and completes the sum of squares across the devices
    (``par.feature_sum(var, sum_of_squares, n) -> (total, n_total)``)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float = 1e-6, axis: str | None = None,
                 param_dtype=jnp.float32):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones_init(), (dim,), axis, dtype=param_dtype)

    def __call__(self, x, par=None):
        xf = x.astype(jnp.float32)
        ss, n = jnp.sum(jnp.square(xf), axis=-1, keepdims=True), x.shape[-1]
        if par is not None:
            ss, n = par.feature_sum(self.scale, ss, n)
        y = xf * jax.lax.rsqrt(ss / n + self.eps) * self.scale[...].astype(jnp.float32)
        return y.astype(x.dtype)


class StackedDiT(nnx.Module):
    """``embed`` -> ``cfg.num_layers`` stacked ``blocks`` -> ``head``: the modules of a one-stack DiT
    built from the family's ``EMBED`` / ``BLOCK`` / ``HEAD`` classes (each ``cls(cfg, rngs=,
    param_dtype=)``), with :class:`vidax.core.runner.DiTRunner`'s default ``step``: the block on the
    carry's ``h`` and every constant."""

    EMBED = BLOCK = HEAD = None

    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        self.embed = self.EMBED(cfg, rngs=rngs, param_dtype=param_dtype)
        self.blocks = stack(lambda r: self.BLOCK(cfg, rngs=r, param_dtype=param_dtype), cfg.num_layers, rngs)
        self.head = self.HEAD(cfg, rngs=rngs, param_dtype=param_dtype)

    @staticmethod
    def step(blk, carry, consts, par):
        return {"h": blk(carry["h"], consts, par)}


class LatentPatches:
    """A DiT's ``finish`` where its output tokens ``y`` are the ``cfg.patch_size`` patches (features
    in ``PATCH_ORDER``) of the channels-last latents ``x`` [B, F, H, W, C]: those latents."""

    PATCH_ORDER = "thwc"

    def finish(self, out: dict, shapes: dict):
        patch = self.cfg.patch_size
        return geometry.unpatchify(out["y"], geometry.token_grid(shapes["x"][1:4], patch), patch, self.PATCH_ORDER)


class TextDiT(StackedDiT):
    """A :class:`StackedDiT` whose blocks cross-attend to the text ``ctx`` through ``attn2``
    (``attn2.context_kv(ctx, par)``): those keys / values are computed once per sample stage."""

    CONTEXT = ("ctx",)

    @staticmethod
    def kv(blk, c, par):
        """This block's text keys / values, from ``embed.kv_context``."""
        return blk.attn2.context_kv(c["ctx"], par)


def _pick_keymap(diffusers_keymap, original_keymap, cfg, original: bool):
    return original_keymap(cfg) if original else diffusers_keymap(cfg)


def _describe(name: str, cfg) -> str:
    return f"{name} (dim {cfg.dim}, {cfg.num_layers} layers)"


class ModelKit:
    """The construction helpers a family's top-level module exposes, written once. ``cls(cfg,
    rngs=, param_dtype=)`` builds the module; ``units`` names the graphdefs the runners merge one
    unit at a time (name -> dotted attribute path, e.g. ``{"blocks": "blocks"}``);
    ``dtype_leaf`` is the state path whose dtype is the checkpoint's. A family module binds the
    methods to its own names (``init_model = KIT.init_model`` ...), so its public API is unchanged::

        KIT = nn.ModelKit(WanTransformer, units=("embed", "blocks", "head"), dtype_leaf=("embed", "patch", "kernel"))
    """

    def __init__(self, cls, units, dtype_leaf: tuple[str, ...]):
        self.cls = cls
        self.units = dict(units) if isinstance(units, dict) else {u: u for u in units}
        self.dtype_leaf = tuple(dtype_leaf)
        self.graphdefs = functools.lru_cache(maxsize=None)(self._graphdefs)

    def build(self, cfg, seed: int = 0, dtype=np.float32):
        return self.cls(cfg, rngs=nnx.Rngs(seed), param_dtype=jnp.dtype(dtype))

    def init_model(self, cfg, seed: int = 0, dtype=np.float32):
        """A seeded random module (presets, tests): every weight perturbed (no zero biases, no unit norms)."""
        return perturb(self.build(cfg, seed, dtype), seed)

    def init_state(self, cfg, seed: int = 0, dtype=np.float32) -> nnx.State:
        """:meth:`init_model`'s state in host memory (numpy leaves)."""
        return jax.tree.map(np.asarray, nnx.state(self.init_model(cfg, seed, dtype)))

    def abstract_state(self, cfg, dtype=np.float32) -> nnx.State:
        return jax.tree.map(lambda x: x, nnx.state(self.abstract_model(cfg, dtype)))

    def param_shapes(self, cfg, dtype=np.float32) -> dict:
        return nnx.to_pure_dict(nnx.state(self.abstract_model(cfg, dtype)))

    def _graphdefs(self, cfg, dtype: str = "float32") -> dict:
        m = self.abstract_model(cfg, dtype)
        out = {"model": nnx.graphdef(m)}
        for name, path in self.units.items():
            unit = m
            for part in path.split("."):
                unit = getattr(unit, part)
            out[name] = nnx.graphdef(unit)
        return out

    def state_dtype(self, state) -> np.dtype:
        leaf = state
        for k in self.dtype_leaf:
            leaf = leaf[k]
        return np.dtype(jax.tree.leaves(leaf)[0].dtype)

    def merge(self, state, cfg):
        return nnx.merge(self.graphdefs(cfg, self.state_dtype(state).name)["model"], state)

    def abstract_model(self, cfg, dtype: str = "float32"):
        """The module with ``jax.ShapeDtypeStruct`` leaves (cached): what the runner reads its
        hooks and graph definitions from."""
        return self._abstract(cfg, np.dtype(dtype).name)

    def _abstract(self, cfg, dtype: str):
        return abstract_module(functools.partial(self.build, cfg, 0, dtype))

    def load(self, path, cfg, dtype, *, from_config, keymap, what, is_original=None, config_from_original=None,
             prefix: str | None = None, keep_others: bool = False, view=None):
        """``(host state, cfg)`` from a diffusers folder (``from_config`` of its ``config.json`` when
        ``cfg`` is None) or an original-release checkpoint (``is_original(names)``; its config from
        ``config_from_original(ckpt)`` when none is given): the abstract state filled tensor by
        tensor, cast on the host; nothing random is materialised. ``prefix`` (e.g.
        ``"model.diffusion_model."``) is stripped where the names carry it (the other names
        dropped unless ``keep_others``); ``keymap(cfg, original)``, or the pair ``(diffusers_keymap,
        original_keymap)`` of ``keymap(cfg)``; ``what(cfg)`` names the model, or ``what`` is the
        reference class's name (``"<what> (dim D, N layers)"``); ``view(ckpt, cfg, original)``: the
        checkpoint as ``keymap`` reads it (an original release renamed, say)."""
        from pathlib import Path

        from vidax import compat
        from vidax.weights import load_checkpoint_params, open_checkpoint

        if isinstance(keymap, tuple):
            keymap = functools.partial(_pick_keymap, *keymap)
        if isinstance(what, str):
            what = functools.partial(_describe, what)
        path = Path(path)
        if cfg is None and path.is_dir() and (path / "config.json").exists():
            cfg = from_config(compat.read_config(path))
        ckpt = open_checkpoint(path)
        names = list(ckpt)
        if prefix and any(n.startswith(prefix) for n in names):
            ckpt = {n.removeprefix(prefix): ckpt[n] for n in names if keep_others or n.startswith(prefix)}
        pure, cfg = load_checkpoint_params(
            ckpt, cfg, is_original=is_original or (lambda names: False), config_from_original=config_from_original,
            keymap=keymap, shapes=lambda c: self.param_shapes(c, dtype), dtype=dtype, what=what, source=path, view=view)
        return fill(self.abstract_state(cfg, dtype), pure), cfg

    def runner(self, state, cfg, mesh=None, parallelism=None, **kw):
        """:class:`vidax.core.runner.DiTRunner` of this model for ``state`` (host numpy preferred,
        or the module)."""
        from vidax.core.runner import DiTRunner

        if isinstance(state, nnx.Module):
            state = nnx.state(state)
        return DiTRunner(self.abstract_model(cfg, self.state_dtype(state).name), state, mesh, parallelism, **kw)
