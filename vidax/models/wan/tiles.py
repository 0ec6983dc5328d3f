"""Tiled decode with the Wan VAE (also the Cosmos and Cosmos3 VAE): the reference's ``enable_tiling``
decode, its persisted decode stages (tile groups x frame ranges) and the ``TileStages`` pipeline mixin."""
from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core import conv as vconv
from vidax.core.tiles import TILE_SPEC, WHOLE_SPEC, blend_grid, split_even, tile_devices, tile_mesh, tile_shardings
from vidax.models.wan.vae import (WanVAEConfig, decode_chunk_jit, denormalize_latents, param_shapes, patchify,
                                  plan_decode_unit, state_from_pure, to_device, unpatchify)

#: diffusers' AutoencoderKLWan tiling defaults (pixels): 256-pixel tiles every 192 pixels
TILE, TILE_STRIDE = 256, 192
#: a tiled decode's default plan: this many tile groups (each a stage per frame range) ...
TILE_GROUPS = 2
#: ... and at most this many decode stages in all (``decode_stages`` overrides it)
TILE_STAGES = 8


def tile_grid(cfg: WanVAEConfig, height: int, width: int, tile: int | None = None, stride: int | None = None):
    """The latent tiles of a ``height x width`` latent frame: ``[(i, j, rows, cols)]`` in row-major
    order (the reference's loop), each ``tile / ratio`` latents wide, every ``stride / ratio``
    (None: :data:`TILE`, :data:`TILE_STRIDE`, read when called)."""
    tile, stride = TILE if tile is None else tile, TILE_STRIDE if stride is None else stride
    r = cfg.scale_factor_spatial or cfg.spatial_ratio
    lt, ls = tile // r, stride // r
    if lt < 1 or ls < 1 or stride > tile or tile % r or stride % r:
        raise ValueError(f"tile {tile} / stride {stride} pixels: multiples of the VAE's {r}x, stride <= tile")
    return [(i, j, slice(i, i + lt), slice(j, j + lt)) for i in range(0, height, ls) for j in range(0, width, ls)]


def _tile_hw(grid, n: int, height: int, width: int) -> tuple[int, int]:
    """The latent rows and cols of tile ``n`` (edge tiles are cut by the frame)."""
    _, _, ys, xs = grid[n]
    return min(ys.stop, height) - ys.start, min(xs.stop, width) - xs.start


@lru_cache(maxsize=None)
def _tiles_program(mesh, cfg: WanVAEConfig, first: bool, attn_impl, conv_impl: str):
    """One latent frame of ``mesh.size`` same-shape tiles at once, one per device: the tiles are
    stacked on the batch axis (``[N B, z_dim, 1, h, w]``, with their caches) and split over the
    mesh, and every device runs the single-tile program (:func:`decode_chunk_jit`) on its own tile
    -- no communication, the same arithmetic as decoding the tiles one after the other. The caches
    are donated. One program per (mesh, tile shape, first)."""
    from vidax.core.sharding import smap

    def one(state, z, cache):
        return decode_chunk_jit(state, z, cache, cfg=cfg, first=first, attn_impl=attn_impl, conv_impl=conv_impl,
                                 raw=True)

    t, rep = TILE_SPEC, WHOLE_SPEC
    if first:
        return vconv.jit(smap(lambda state, z: one(state, z, None), mesh, (rep, t), (t, t)))
    return vconv.jit(smap(one, mesh, (rep, t, t), (t, t)), donate_argnums=(2,))


def decode_tiles(state, cfg: WanVAEConfig, z, tiles=None, *, start: int = 0, stop: int | None = None, cache=None,
                 return_cache: bool = True, tile: int | None = None, stride: int | None = None, attn_impl=None,
                 conv_impl=None, devices=None):
    """Latent frames ``start .. stop-1`` of some tiles of ``z`` [B, z_dim, F, h, w] (denormalised),
    each tile decoded with its own causal cache, not blended. ``tiles``: indices into
    :func:`tile_grid` (default: all). Returns ``({tile: raw decoder output [B, C p p, T, h_t r/p,
    w_t r/p]}, cache)`` (host numpy; ``r`` the spatial ratio, ``p`` the patch size).

    ``cache`` (needed when ``start > 0``): the tiles' caches left by frame ``start - 1``, keys
    ``"<tile>/<name>"``; the returned one has the same keys for ``tiles`` (host numpy: a tile's
    cache leaves the device when the tile is done; None without ``return_cache``).

    ``devices`` (:func:`tile_devices`): with N > 1 of them, same-shape tiles are decoded N at a time,
    one per device (:func:`_tiles_program`); a batch short of N tiles is filled up with repeats of
    its last tile (outputs dropped; the spare devices would idle anyway, and one mesh means one
    program per tile shape). Tiles of different shapes (the frame's last row and column) are never
    padded to one shape: the decoder's zero padding at the tile's edge and its attention over the
    tile would see the padding. With one device, or one tile of each shape, each tile runs alone."""
    z = np.asarray(z)
    b, _, f, h, w = z.shape
    stop = f if stop is None else stop
    if start > 0 and cache is None:
        raise ValueError("decode_tiles(start > 0) needs the tiles' cache left by the previous chunk")
    grid = tile_grid(cfg, h, w, tile, stride)
    tiles = list(range(len(grid))) if tiles is None else [int(n) for n in tiles]
    if any(not 0 <= n < len(grid) for n in tiles):
        raise ValueError(f"tiles {tiles}: a {h}x{w} latent frame has tiles 0..{len(grid) - 1}")
    by_shape: dict[tuple, list[int]] = {}
    for n in tiles:
        by_shape.setdefault(_tile_hw(grid, n, h, w), []).append(n)
    devs = tile_devices(devices)
    # the whole slice, or one device when no two tiles share a shape (nothing to decode side by side)
    nd = len(devs) if max((len(v) for v in by_shape.values()), default=1) > 1 else 1
    impl = vconv.conv_impl(conv_impl)
    if nd > 1:
        mesh = tile_mesh(tuple(devs[:nd]))
        spread, whole = tile_shardings(mesh)
        state = jax.device_put(state, whole)  # the weights on every device of the mesh

        def put(a):
            return jax.device_put(a, spread)

        def run(zk, c, first):
            prog = _tiles_program(mesh, cfg, first, attn_impl, impl)
            return prog(state, put(zk)) if first else prog(state, put(zk), c)
    else:
        def put(a):
            return jnp.asarray(a)

        def run(zk, c, first):
            return decode_chunk_jit(state, to_device(zk), None if first else c, cfg=cfg, first=first,
                                     attn_impl=attn_impl, conv_impl=impl, raw=True)

    def stack(arrays):
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)

    out, new_cache = {}, {}
    for members in by_shape.values():
        for c0 in range(0, len(members), nd):
            chunk = members[c0:c0 + nd]
            batch = chunk + [chunk[-1]] * (nd - len(chunk))
            c = None
            if start > 0:
                names = sorted(k.split("/", 1)[1] for k in cache if k.split("/", 1)[0] == str(batch[0]))
                lacking = [n for n in chunk if not names or any(f"{n}/{name}" not in cache for name in names)]
                if lacking:
                    raise ValueError(f"decode_tiles: the cache lacks entries of tile(s) {lacking}")
                c = {name: put(stack([np.asarray(cache[f"{n}/{name}"]) for n in batch])) for name in names}
            outs = []
            for k in range(start, stop):
                zk = stack([z[:, :, k:k + 1, grid[n][2], grid[n][3]] for n in batch])
                px, c = run(zk, c, k == 0)
                outs.append(np.asarray(px))
            px = np.concatenate(outs, axis=2) if outs else None
            if return_cache and c is not None:
                c = {name: np.asarray(v) for name, v in c.items()}
            for i, n in enumerate(chunk):
                if px is not None:
                    out[n] = px[i * b:(i + 1) * b]
                if return_cache and c is not None:
                    new_cache.update({f"{n}/{name}": v[i * b:(i + 1) * b] for name, v in c.items()})
    return out, (new_cache if return_cache else None)


def blend_tiles(cfg: WanVAEConfig, raw: dict, height: int, width: int, tile: int | None = None,
                stride: int | None = None):
    """The reference's blend of every tile of a ``height x width`` latent frame: ``raw`` {tile:
    raw decoder output} (:func:`decode_tiles`, the same frames for every tile); each tile's top and
    left overlap cross-fade linearly from its already-blended neighbours, the tiles' first
    ``stride`` pixels are kept, then unpatchify and clamp. Returns pixels [B, C, T, H, W] in [-1, 1]."""
    grid = tile_grid(cfg, height, width, tile, stride)
    tile, stride = TILE if tile is None else tile, TILE_STRIDE if stride is None else stride
    missing = [n for n in range(len(grid)) if n not in raw]
    if missing:
        raise ValueError(f"blend_tiles: tiles {missing} of the {len(grid)} are missing")
    p = cfg.patch_size or 1
    r = cfg.scale_factor_spatial or cfg.spatial_ratio
    rows: dict[int, list] = {}
    for n, (i, *_) in enumerate(grid):
        rows.setdefault(i, []).append(raw[n])
    sh, sw = height * r // p, width * r // p  # the decoder's output grid (patchified)
    ss = stride // p
    joined = blend_grid([rows[i] for i in sorted(rows)], tile // p - ss, ss, (-2, -1))
    dec = joined[..., :sh, :sw]  # [B, C p p, T, H/p, W/p]
    x = np.asarray(unpatchify(dec.transpose(0, 2, 3, 4, 1), p)).transpose(0, 4, 1, 2, 3)
    return np.clip(x, -1.0, 1.0)


def tiled_decode(state, cfg: WanVAEConfig, z, *, start: int = 0, stop: int | None = None, cache=None,
                 return_cache: bool = False, tile: int | None = None, stride: int | None = None, attn_impl=None,
                 conv_impl=None, devices=None):
    """:func:`decode` in overlapping spatial tiles, as ``AutoencoderKLWan.tiled_decode`` (after
    ``enable_tiling(tile_sample_min_*=tile, tile_sample_stride_*=stride)``): each latent tile is
    decoded frame by frame with its own causal cache, neighbours are cross-faded linearly over the
    overlap, then unpatchified and clamped (:func:`decode_tiles`, :func:`blend_tiles`). Each compiled
    program sees one tile, so the peak memory follows the tile, not the frame; with several
    ``devices`` (default: this process's) same-shape tiles decode one per device at once.
    Resumable like :func:`decode`: ``cache`` holds every tile's cache (keys ``"<tile index>/<name>"``,
    host numpy)."""
    z = np.asarray(z)
    h, w = z.shape[-2:]
    raw, new_cache = decode_tiles(state, cfg, z, start=start, stop=stop, cache=cache, return_cache=return_cache,
                                  tile=tile, stride=stride, attn_impl=attn_impl, conv_impl=conv_impl, devices=devices)
    pixels = blend_tiles(cfg, raw, h, w, tile, stride)
    return (pixels, new_cache) if return_cache else pixels


# --------------------------------------------------------------- tiled decode as persisted stages
def tile_groups(cfg: WanVAEConfig, height: int, width: int, groups: int, tile: int | None = None,
                stride: int | None = None) -> list[tuple[tuple[int, int, int, int], list[int]]]:
    """``groups`` blocks of the tile grid of a ``height x width`` latent frame -- bands of whole tile
    rows; a band's columns are split too when there are more groups than tile rows -- as
    ``[(latent box (y0, y1, x0, x1) the block's tiles cover, [tile indices, row-major])]``."""
    grid = tile_grid(cfg, height, width, tile, stride)
    rows = sorted({g[0] for g in grid})
    cols = sorted({g[1] for g in grid})
    if not 1 <= groups <= len(grid):
        raise ValueError(f"{groups} tile groups: between 1 and the {len(grid)} tiles of a {height}x{width} "
                         "latent frame")
    gr = min(groups, len(rows))
    gc = min(len(cols), max(1, groups // gr))
    out = []
    for band in split_even(rows, gr):
        for block in split_even(cols, gc):
            members = [n for n, g in enumerate(grid) if g[0] in band and g[1] in block]
            last = members[-1]
            box = (band[0], min(height, grid[last][2].stop), block[0], min(width, grid[last][3].stop))
            out.append((box, members))
    return out


def tile_plan(cfg: WanVAEConfig, latent_frames: int, height: int, width: int, stages: int | None = None,
              inputs=("latents",)) -> list:
    """The decode stages of a tiled decode of ``height x width`` latents (``DecodeSpan`` list).

    ``stages`` (the request's ``decode_stages``; default :data:`TILE_STAGES`) bounds the count.
    With more than one tile and ``stages > 1`` the plan is :data:`TILE_GROUPS` tile groups
    (:func:`tile_groups`) x ``min(latent_frames, stages // groups)`` frame ranges: stage ``r G + g``
    decodes group ``g``'s tiles over frame range ``r`` and carries their caches from stage
    ``(r - 1) G + g`` (``carry_from``), so the groups are independent chains; its output is the
    tiles' raw decoder output (:func:`decode_tile_stage`), blended when the video is assembled
    (:func:`assemble_tile_stages`). Otherwise (one tile, or one stage) the plan is frame ranges
    alone, each decoding and blending every tile (:func:`tiled_decode`)."""
    from vidax.pipeline import DecodeSpan, temporal_spans

    k = TILE_STAGES if stages is None else int(stages)
    g = min(len(tile_grid(cfg, height, width)), TILE_GROUPS, k)
    if g <= 1:
        return temporal_spans(latent_frames, stages, inputs)
    groups = tile_groups(cfg, height, width, g)
    g = len(groups)
    r = max(1, min(latent_frames, k // g))
    bounds = [round(i * latent_frames / r) for i in range(r + 1)]
    spans = []
    for ri in range(r):
        for gi, (box, _) in enumerate(groups):
            n = ri * g + gi
            spans.append(DecodeSpan(f"decode/{n}", "video", (bounds[ri], bounds[ri + 1]), box,
                                    f"decode/{n - g}" if ri else None, tuple(inputs)))
    return spans


def _plan_groups(cfg: WanVAEConfig, boxes) -> tuple[int, int, dict]:
    """(latent height, width, {box: [tile indices]}) of a tile plan's distinct boxes."""
    boxes = list(dict.fromkeys(tuple(b) for b in boxes))
    h, w = max(b[1] for b in boxes), max(b[3] for b in boxes)
    members = {box: m for box, m in tile_groups(cfg, h, w, len(boxes))}
    unknown = [b for b in boxes if b not in members]
    if unknown:
        raise ValueError(f"tile boxes {unknown} are not the tile groups of a {h}x{w} latent frame in "
                         f"{len(boxes)} groups")
    return h, w, members


def decode_tile_stage(vae, latents, span, carry, plan, devices=None):
    """One stage of a :func:`tile_plan`: the tiles of ``span.tile``'s group over latent frames
    ``span.frames``, from ``carry`` (their caches left by the group's previous frame range).

    ``vae``: ``(state, cfg)``; ``latents``: the run's normalised latents [B, z_dim, F, h, w];
    ``plan``: the run's decode plan (to tell the groups apart). Returns ``(tiles, carry)``: the
    tiles' raw decoder output (float32, unclamped, unpatchified) laid side by side in the group's
    row-major order -- an atlas [B, T, sum of the tile rows' heights, sum of the tile columns'
    widths, C] -- and the tiles' caches for the group's next frame range (None when no stage of
    ``plan`` carries on from this one)."""
    state, cfg = vae
    z = denormalize_latents(cfg, np.asarray(latents, np.float32))
    h, w = z.shape[-2:]
    ph, pw, groups = _plan_groups(cfg, [s.tile for s in plan if s.tile is not None])
    if (ph, pw) != (h, w) or tuple(span.tile) not in groups:
        raise ValueError(f"{span.name}: tile {span.tile} is not a tile group of the plan for {h}x{w} latents")
    members = groups[tuple(span.tile)]
    a, b = span.frames
    carried = any(s.carry_from == span.name for s in plan)
    raw, cache = decode_tiles(state, cfg, z, members, start=a, stop=b, cache=carry, return_cache=carried,
                              devices=devices)
    p = cfg.patch_size or 1
    grid = tile_grid(cfg, h, w)
    rows: dict[int, list] = {}
    for n in members:
        px = np.asarray(unpatchify(raw[n].transpose(0, 2, 3, 4, 1), p), np.float32)  # [B, T, H, W, C]
        rows.setdefault(grid[n][0], []).append(px)
    atlas = np.concatenate([np.concatenate(r, axis=3) for _, r in sorted(rows.items())], axis=2)
    return atlas, cache


def assemble_tile_stages(cfg: WanVAEConfig, parts) -> np.ndarray:
    """The video [B, C, T, H, W] in [-1, 1] from the ``(span, tiles)`` of every stage of a
    :func:`tile_plan` (:func:`decode_tile_stage`): each frame range's tiles blended as the
    reference's tiled decode blends them (:func:`blend_tiles`), the ranges concatenated."""
    h, w, groups = _plan_groups(cfg, [s.tile for s, _ in parts])
    r = cfg.scale_factor_spatial or cfg.spatial_ratio
    p = cfg.patch_size or 1
    grid = tile_grid(cfg, h, w)
    ranges: dict[tuple, dict] = {}
    for span, atlas in parts:
        atlas = np.asarray(atlas, np.float32)
        members = groups[tuple(span.tile)]
        tiles = ranges.setdefault(tuple(span.frames), {})
        y = 0
        for i in sorted({grid[n][0] for n in members}):
            x = 0
            for n in (m for m in members if grid[m][0] == i):
                th, tw = (d * r for d in _tile_hw(grid, n, h, w))
                px = atlas[:, :, y:y + th, x:x + tw]
                tiles[n] = np.asarray(patchify(px, p)).transpose(0, 4, 1, 2, 3)  # back to the decoder's layout
                x += tw
            y += th
        if (y, x) != atlas.shape[2:4]:
            raise ValueError(f"{span.name}: tiles of {atlas.shape[2]}x{atlas.shape[3]} pixels, the group's tiles "
                             f"cover {y}x{x}")
    out = [blend_tiles(cfg, tiles, h, w) for _, tiles in sorted(ranges.items())]
    return np.concatenate(out, axis=2)


class TileStages:
    """The decode plan of the pipelines that decode with this VAE (Wan, Cosmos, Cosmos3), mixed in
    before :class:`vidax.pipeline.Pipeline`: with the ``vae_tiling`` option the decode stages are
    tile groups x frame ranges (:func:`tile_plan`), each persisted and rerunnable alone, and the
    video is assembled by blending their tiles (:func:`assemble_tile_stages`). The pipeline's
    ``decode`` hands a span with a ``tile`` to :meth:`decode_tile_span`. Uses the pipeline's
    ``latent_shape``, ``vae_config`` and ``load_vae``."""

    def decode_plan(self, request):
        if request.options.get("vae_tiling"):
            _, f, h, w, _ = self.latent_shape(1, request.height, request.width, request.num_frames)
            return tile_plan(self.vae_config(), f, h, w, getattr(request, "decode_stages", None))
        return super().decode_plan(request)

    def decode_tile_span(self, latents: dict, span, carry, request, vae=None):
        """One tile stage: ``({"frames": the tiles' raw decoder output (float32 atlas)}, carry)``."""
        from vidax.pipeline import Named

        tiles, cache = decode_tile_stage(vae or self.load_vae(), latents["latents"], span, carry,
                                         self.decode_plan(request))
        return ({"frames": Named(tiles, ("batch", "frame", "height", "width", "rgb"),
                                 {"latent_frames": list(span.frames), "tile": list(span.tile),
                                  "units": "raw decoder output (float32, unclamped): the group's tiles side by side, "
                                           "row-major; mux blends them"})}, cache)

    def assemble_video(self, parts):
        if any(span.tile is not None for span, _ in parts):
            from vidax.pipeline import to_uint8, to_unit_range

            return to_uint8(to_unit_range(assemble_tile_stages(self.vae_config(), parts)))
        return super().assemble_video(parts)


#: the ``vae_tiling`` request option of the families decoding with this VAE (Wan, Cosmos, Cosmos3)
def tiling_option():
    from vidax.pipeline import Option

    return Option("vae_tiling", bool, False, f"decode in overlapping {TILE}-pixel spatial tiles (the reference's "
                  "enable_tiling): each program holds one tile, so 720p decodes fit a 16 GiB chip; tiles of one "
                  "shape decode one per device of the decode slice; with several tiles the decode stages are "
                  "tile groups x frame ranges", stages=("decode",))


def plan_tiles_unit(cfg: WanVAEConfig, batch: int, height: int, width: int, dtype=np.float32, devices: int = 1):
    """The program a tiled decode stage repeats on a ``devices``-chip slice (``vidax plan``): one
    latent frame of ``devices`` full-size tiles at once, one per device, with their causal caches
    (:func:`_tiles_program`, as :func:`decode_tiles` runs it); on one chip, or when one tile covers
    the ``height x width`` latent frame, the single-tile program. Compiled on the first ``devices``
    of ``jax.devices()`` (fake CPU devices for a plan)."""
    from vidax.core import plan as vplan

    lt = TILE // (cfg.scale_factor_spatial or cfg.spatial_ratio)
    th, tw = min(height, lt), min(width, lt)
    nd = min(int(devices), jax.device_count()) if len(tile_grid(cfg, height, width)) > 1 else 1
    if nd <= 1:
        unit = plan_decode_unit(cfg, batch, th, tw, dtype)
        unit.name = f"VAE decode, one latent frame of one {TILE}-px tile"
        return unit
    mesh = tile_mesh(tuple(jax.devices()[:nd]))
    state = state_from_pure(cfg, param_shapes(cfg, dtype))
    z1 = vplan.abstract((batch, cfg.z_dim, 1, th, tw), np.float32)
    _, cache1 = jax.eval_shape(partial(decode_chunk_jit, cfg=cfg, first=True, attn_impl=None, conv_impl="native"),
                               state, z1, None)
    spread, whole = tile_shardings(mesh)
    state = vplan.like(state, whole)
    z = vplan.abstract((nd * batch, *z1.shape[1:]), np.float32, spread)
    cache = {k: vplan.abstract((nd * v.shape[0], *v.shape[1:]), v.dtype, spread) for k, v in cache1.items()}
    return vplan.Unit("decode", f"VAE decode, one latent frame of {nd} {TILE}-px tiles (one per device)",
                      _tiles_program(mesh, cfg, False, None, "native"), (state, z, cache), weights=state,
                      note=f"{batch} x {th}x{tw} latents per device with the causal cache")
