"""``vidax plan``: will a request fit the chips its stages are routed to? Answered before any weight
is read.

For a request (a model at its default size, or any size) and the pools of the recipe (or a mesh
and pools given on the command line), each stage's compiled unit is built from abstract shapes --
the prompt encoder's forward, one sampling step's DiT call on the guidance batch, one decode
stage -- and compiled on as many devices as the pool has (fake CPU devices here, real ones on a
slice). The compiler's memory analysis gives the bytes one device holds: arguments (weights and
inputs), outputs and temporaries; their sum is the stage's per-device peak, set against the
chip's HBM (:data:`vidax.core.plan.CHIPS`). A stage that does not fit is named with its shortfall
and the knobs that would bring it down (bf16, a larger tp, weight offloading...).

``generate`` runs the same check on the devices it has before any stage starts when their memory
is known (TPU / GPU, or ``VIDAX_DEVICE_MEMORY`` set), refuses a request that cannot fit, and
records the plan in the run's manifest.

Figures are the compiler's for the backend it compiles on: on CPU (fake devices) the buffer
assignment and the attention path are the CPU's, so treat them as an estimate of the TPU/GPU
program (the same arguments; temporaries of the same order).

    vidax plan --model wan2.1-t2v-14b                    # the release's size on its pools
    vidax plan --model cogvideox-5b --checkpoint /models/CogVideoX-5b --mesh dp=2,tp=4
    from stages.plan import plan; p = plan("wan2.1-t2v-14b"); print(p.table()); p.fits
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from stages.request import Request, RequestError
from vidax import registry
from vidax.core.plan import GiB, UnitMemory, chip, fmt_bytes

KINDS = ("encode", "sample", "decode")
#: the share of a chip's HBM a plan may use (the runtime, the compiler's scratch and fragmentation need the rest)
HEADROOM = 0.92


@dataclass
class StagePlan:
    kind: str
    accelerator: str | None
    chips: int
    chip: str
    hbm: int | None  # bytes per chip (None: unknown / no limit)
    mesh: str | None
    units: list[UnitMemory]
    knobs: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max((u.peak for u in self.units), default=0)

    @property
    def budget(self) -> int | None:
        return None if self.hbm is None else int(self.hbm * HEADROOM)

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.peak <= self.budget

    @property
    def shortfall(self) -> int:
        return 0 if self.budget is None else max(0, self.peak - self.budget)

    @property
    def verdict(self) -> str:
        if self.fits is None:
            return "no limit known"
        return "fits" if self.fits else f"DOES NOT FIT (short {fmt_bytes(self.shortfall)})"

    def to_json(self) -> dict:
        return {"stage": self.kind, "accelerator": self.accelerator, "chip": self.chip, "chips": self.chips,
                "hbm": self.hbm, "budget": self.budget, "mesh": self.mesh, "peak": self.peak, "fits": self.fits,
                "shortfall": self.shortfall, "units": [u.to_json() for u in self.units], "knobs": self.knobs}


@dataclass
class Plan:
    model: str
    source: str
    height: int
    width: int
    num_frames: int
    dtype: str
    batch: int
    stages: list[StagePlan]

    @property
    def fits(self) -> bool:
        return all(s.fits is not False for s in self.stages)

    def failing(self) -> list[StagePlan]:
        return [s for s in self.stages if s.fits is False]

    def table(self) -> str:
        head = (f"plan {self.model} ({self.source}) {self.width}x{self.height}x{self.num_frames}, {self.dtype}, "
                f"{self.batch} prompt(s)")
        rows = [("stage", "pool", "mesh", "unit", "weights", "args", "temps", "peak/device", "HBM", "verdict")]
        for s in self.stages:
            pool = f"{s.chip} x{s.chips}" if s.accelerator else "local"
            for i, u in enumerate(s.units):
                rows.append((s.kind if i == 0 else "", pool if i == 0 else "", (s.mesh or "1 device") if i == 0 else "",
                             u.name, fmt_bytes(u.weights), fmt_bytes(u.arguments), fmt_bytes(u.temporaries),
                             fmt_bytes(u.peak), fmt_bytes(s.hbm) if i == 0 else "", s.verdict if i == 0 else ""))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        for s in self.stages:
            for u in s.units:
                if u.comm_bytes:
                    parts = ", ".join(f"{_COMM_NAMES[k]} {fmt_bytes(v)}" for k, v in u.comm.items())
                    lines.append(f"  {s.kind}: sequence parallel sends ~{fmt_bytes(u.comm_bytes)} per device per "
                                 f"{u.name} ({parts}; mesh {s.mesh})")
            for k in s.knobs:
                lines.append(f"  {s.kind}: {k}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"model": self.model, "source": self.source, "height": self.height, "width": self.width,
                "num_frames": self.num_frames, "dtype": self.dtype, "batch": self.batch, "fits": self.fits,
                "stages": [s.to_json() for s in self.stages]}


_COMM_NAMES = {"all_to_all": "Ulysses all_to_all", "ring": "ring K/V", "gather": "joint-token gather"}


class PlanError(RequestError):
    """The request cannot fit its devices (``field``: the stage)."""


# ------------------------------------------------------------------ pools
def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"{text!r}: a size like 16GiB, 512MiB or a number of bytes")
    n, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B").rstrip("I")
    return int(n * {"": 1, "K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}[unit])


def parse_pools(specs) -> dict[str, tuple[str, int]]:
    """``["sample=tpu-v5p-slice:8", "encode=tpu-v5-lite-podslice:4"]`` -> {kind: (accelerator, chips)}."""
    out = {}
    for spec in specs or ():
        m = re.fullmatch(r"(encode|sample|decode)=([\w.-]+):([1-9]\d*)", spec.strip())
        if not m:
            raise RequestError("pool", f"{spec!r}: use STAGE=ACCELERATOR:CHIPS, e.g. sample=tpu-v5p-slice:8 "
                                       f"(STAGE: encode, sample or decode)")
        out[m.group(1)] = (m.group(2), int(m.group(3)))
    return out


def _pools(recipe, preset: str | None, given: dict) -> dict[str, tuple[str | None, int]]:
    pools = {}
    for kind in KINDS:
        if kind in given:
            pools[kind] = given[kind]
            continue
        jv = recipe.job_variables(kind, preset)
        pools[kind] = (jv.get("tpu_accelerator"), int(jv.get("tpu_chips") or 1)) if jv else (None, 1)
    return pools


def devices_needed(model: str | None = None, preset: str | None = None, pools=None, mesh: str | None = None) -> int:
    """How many devices a plan of this request compiles on (the largest pool, or the mesh)."""
    recipe = registry.get(model or registry.default_model())
    n = max(c for _, c in _pools(recipe, preset, parse_pools(pools) if isinstance(pools, list) else (pools or {})).values())
    if mesh and mesh != "auto":
        from vidax.core.mesh import parse_mesh_spec

        n = max(n, _mesh_size(parse_mesh_spec(mesh)))
    return n


def _mesh_size(sizes) -> int:
    n = 1
    for v in sizes.values():
        n *= max(1, int(v))
    return n


# ------------------------------------------------------------------ the plan
def plan(model: str | None = None, *, preset: str | None = None, checkpoint: str | None = None,
         height: int | None = None, width: int | None = None, num_frames: int | None = None, prompts: int = 1,
         guidance: float | None = None, dtype: str | None = None, mesh: str | None = None, pools=None,
         hbm: int | str | None = None, options: dict | None = None, request: Request | None = None,
         log=None) -> Plan:
    """The memory plan of a request (see the module docstring). Without ``preset`` and
    ``checkpoint``: the release's size, from the configs shipped with the recipe. ``pools``:
    {stage kind: (accelerator, chips)} or ``["sample=ACCEL:CHIPS", ...]`` (default: the recipe's);
    ``hbm``: bytes (or "16GiB") per chip for every stage, overriding the accelerator's."""
    import jax

    from stages.request import validate

    if request is None:
        model = model or registry.default_model()
        recipe = registry.get(model)
        source = checkpoint
        if checkpoint is None and preset is None:
            folder = recipe.config_folder
            if folder is None:
                raise RequestError("model", f"{model}: no release configs ship with vidax for a real-size plan; give "
                                            f"--checkpoint FOLDER (only its config files are read) or --preset tiny")
            source = str(folder)
        request = Request(model=model, prompt=["plan"] * max(1, int(prompts)), preset=preset, checkpoint=source,
                          height=height, width=width, num_frames=num_frames, guidance=guidance, dtype=dtype,
                          mesh=mesh, options=dict(options or {}))
    # an image-to-video plan has no image: build the recipe's image-to-video preset, not its text-to-video one
    rec = registry.MODELS.get(request.model)
    i2v = rec is not None and (request.image is not None or rec.image == "required")
    pipe_v = rec.build(request.preset, None, True, dtype=request.resolved().dtype) if (
        i2v and request.checkpoint is None and request.preset in rec.presets) else None
    req = validate(request, pipe_v, plan=True)
    recipe = registry.get(req.model)
    given = parse_pools(pools) if isinstance(pools, (list, tuple)) else dict(pools or {})
    pool_of = _pools(recipe, None if req.checkpoint else req.preset, given)
    need = max(c for _, c in pool_of.values())
    sample_mesh = req.mesh
    pipe0 = recipe.build(req.preset, req.checkpoint, i2v, dtype=req.dtype)
    geo = pipe0.geometry()
    cfg_parallel = type(pipe0).GUIDANCE == "cfg" and req.guidance > 1.0
    if sample_mesh in (None, "auto"):
        sample_mesh = recipe.default_mesh(pool_of["sample"][1], geo.num_heads,
                                          geo.tokens(req.height, req.width, req.num_frames), cfg_parallel)
    if sample_mesh:
        from vidax.core.mesh import parse_mesh_spec

        need = max(need, _mesh_size(parse_mesh_spec(sample_mesh)))
    if jax.device_count() < need:
        raise RequestError("pool", f"this plan compiles on {need} devices, {jax.device_count()} visible "
                                   f"({jax.default_backend()}); run `vidax plan` as its own command (it fakes "
                                   f"{need} CPU devices) or set XLA_FLAGS=--xla_force_host_platform_device_count={need}")
    pipe = recipe.build(req.preset, req.checkpoint, i2v, dtype=req.dtype, mesh=sample_mesh,
                        offload_chunk_size=req.offload_chunk_size)
    hbm_all = parse_bytes(hbm) if isinstance(hbm, str) else hbm
    units = _units(pipe, req, log)
    stages = []
    for kind in KINDS:
        accel, chips = pool_of[kind]
        name, mem = chip(accel)
        if hbm_all is not None:
            mem = hbm_all
        mine = [u for u in units if u.stage == kind]
        spread = max((u.devices for u in mine), default=1)
        sp = StagePlan(kind, accel, chips, name, mem,
                       sample_mesh if kind == "sample" else (f"tp={spread}" if spread > 1 else None), mine)
        if sp.fits is False:
            sp.knobs = knobs(sp, req, pipe, recipe, geo)
        stages.append(sp)
    src = req.preset if not req.checkpoint else ("release configs" if request.checkpoint and str(
        request.checkpoint) == str(recipe.config_folder) else req.checkpoint)
    return Plan(req.model, src, req.height, req.width, req.num_frames, req.dtype, len(req.prompts), stages)


def _units(pipe, req, log) -> list[UnitMemory]:
    from vidax.core.plan import measure

    try:
        units = pipe.plan_units(req)
    except NotImplementedError as e:
        raise RequestError("model", str(e)) from None
    out = []
    for u in units:
        m = measure(u)
        if log:
            log(f"[plan] {u.stage}: {u.name}: peak {fmt_bytes(m.peak)} per device (compiled in {m.compile_seconds:.1f}s)")
        out.append(m)
    return out


def knobs(sp: StagePlan, req, pipe, recipe, geo) -> list[str]:
    """What would bring a stage that does not fit under its chips' budget (estimates)."""
    out = []
    unit = max(sp.units, key=lambda u: u.peak)
    w, rest = unit.weights, unit.peak - unit.weights
    if req.dtype == "float32" and sp.kind == "sample":
        out.append(f"--dtype bfloat16: the DiT's weights and activations in half the bytes "
                   f"(~{fmt_bytes(unit.peak // 2)} per device)")
    if sp.kind == "sample":
        from vidax.core.mesh import parse_mesh_spec

        sizes = parse_mesh_spec(sp.mesh) if sp.mesh else {}
        tp, spd, dp = (int(sizes.get(a, 1)) for a in ("tp", "sp", "dp"))
        for k in (2, 4, 8):
            if geo.num_heads % (tp * k) == 0:  # sp is free of the heads (Ulysses x ring)
                out.append(f"--mesh dp={dp},tp={tp * k}" + (f",sp={spd}" if spd > 1 else "") +
                           f" on {dp * tp * k * spd} chips: weights ~{fmt_bytes(w // k)} per device")
                break
        if w:
            out.append(f"--offload-chunk-size N: stream the DiT blocks from host memory; resident weights drop "
                       f"from {fmt_bytes(w)} to about two chunks of N blocks")
        if rest > w:
            out.append(f"activations dominate ({fmt_bytes(rest)} per device): a larger sp (Ulysses) splits the tokens")
    else:
        on = "one device" if unit.devices == 1 else f"{unit.devices} devices"
        out.append(f"a pool with larger chips (this stage runs its {unit.name} on {on}: "
                   f"{fmt_bytes(unit.peak)} needed per device, {fmt_bytes(sp.budget)} usable per {sp.chip})")
    if sp.kind == "decode":
        opts = [o for o in recipe.options if "til" in o.name]
        if not opts:
            out.append("this family decodes whole frames: spatial tiling is not built for it yet")
        elif not any(req.options.get(o.name) for o in opts):
            out.append(f"decode in spatial tiles ({', '.join(f'{o.flag} true' for o in opts)})")
    return out


# ------------------------------------------------------------------ generate's check
def device_memory() -> int | None:
    """Bytes one local device may use: ``VIDAX_DEVICE_MEMORY`` (e.g. "16GiB") if set, else the
    device's own limit (TPU / GPU); None on CPU (no check)."""
    v = os.environ.get("VIDAX_DEVICE_MEMORY", "").strip()
    if v:
        return parse_bytes(v)
    import jax

    d = jax.local_devices()[0]
    if d.platform == "cpu":
        return None
    try:
        stats = d.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return stats.get("bytes_limit")


def check_fits(req: Request, pipe, kinds=KINDS, log=None) -> dict | None:
    """Plan ``kinds`` of ``req`` on this process's devices when their memory is known; raise
    :class:`PlanError` naming the first stage that cannot fit. Returns the plan's JSON, or None when
    no limit is known (CPU)."""
    limit = device_memory()
    if limit is None:
        return None
    import jax

    units = [u for u in _units(pipe, req, log) if u.stage in kinds]
    stages = []
    for kind in kinds:
        sp = StagePlan(kind, jax.devices()[0].device_kind, jax.device_count(), jax.devices()[0].device_kind, limit,
                       req.mesh if kind == "sample" else None, [u for u in units if u.stage == kind])
        stages.append(sp)
        if sp.fits is False:
            raise PlanError(sp.kind, f"{req.model} at {req.width}x{req.height}x{req.num_frames} ({req.dtype}) needs "
                                     f"{fmt_bytes(sp.peak)} per device in its {kind} stage, {fmt_bytes(sp.budget)} "
                                     f"usable of {fmt_bytes(limit)}: short {fmt_bytes(sp.shortfall)}; try "
                                     f"`vidax plan --model {req.model}` for the knobs (bf16, tp, offloading)")
    return {"devices": jax.device_count(), "device_memory": limit, "stages": [s.to_json() for s in stages]}


# ------------------------------------------------------------------ CLI
def add_parser(sub, model: str | None = None):
    p = sub.add_parser("plan", help="per-device memory of each stage on its pool, compiled at abstract shapes "
                                    "(no weights loaded), with a verdict and the knobs that make it fit")
    p.add_argument("--model", default=registry.default_model())
    p.add_argument("--preset", help="a preset's size (default: the release's size from its shipped configs)")
    p.add_argument("--checkpoint", help="a checkpoint folder: only its config files are read")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--prompts", type=int, default=1, help="prompts per run (the batch)")
    p.add_argument("--guidance", type=float)
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the DiT's dtype (default: the recipe's: bfloat16 for the large releases, float32 otherwise)")
    p.add_argument("--mesh", help="the sampling mesh (default: what --mesh auto picks on the sample pool)")
    p.add_argument("--pool", action="append", default=[], metavar="STAGE=ACCELERATOR:CHIPS",
                   help="route a stage elsewhere, e.g. sample=tpu-v5p-slice:8 (repeatable)")
    p.add_argument("--hbm", help="bytes per chip for every stage, e.g. 16GiB (overrides the accelerator's)")
    p.add_argument("--json", help="also write the plan as JSON to this path")
    return p


def ensure_devices(argv) -> None:
    """Before JAX starts: fake as many CPU devices as the plan in ``argv`` compiles on."""
    if "jax" in os.sys.modules:
        import jax._src.xla_bridge as xb

        if xb.backends_are_initialized():
            return
    pre = __import__("argparse").ArgumentParser(add_help=False)
    for a in ("--model", "--preset", "--mesh", "--checkpoint"):
        pre.add_argument(a)
    pre.add_argument("--pool", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    try:
        n = devices_needed(known.model, known.preset if not known.checkpoint else None, known.pool, known.mesh)
    except (ValueError, RequestError):
        return  # the command itself reports the bad argument
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if m is None or int(m.group(1)) < n:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={max(n, 8)}".strip()


def cmd_plan(a) -> int:
    import json

    try:
        hbm = parse_bytes(a.hbm) if a.hbm else None
    except ValueError as e:
        raise RequestError("hbm", str(e)) from None
    p = plan(a.model, preset=a.preset, checkpoint=a.checkpoint, height=a.height, width=a.width, num_frames=a.frames,
             prompts=a.prompts, guidance=a.guidance, dtype=a.dtype, mesh=a.mesh, pools=a.pool, hbm=hbm)
    print(p.table())
    if a.json:
        from pathlib import Path

        Path(a.json).write_text(json.dumps(p.to_json(), indent=1) + "\n")
        print(f"plan: {a.json}")
    return 0 if p.fits else 3

