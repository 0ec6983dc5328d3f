"""Checkpoint readers: safetensors (single file or sharded) and PyTorch ``.pth`` zip archives.

Everything is read lazily, tensor by tensor, into host numpy; a tensor can also be read in part
(:meth:`LazyTensor.read` with ``index``), so a device placing one shard of a tensor reads only
that shard.

- ``.safetensors`` goes through the ``safetensors`` library (``safe_open(framework="numpy")``);
  bf16 and fp8 tensors come back as ``ml_dtypes`` arrays.
- ``.pth`` files are opened with a restricted unpickler that only rebuilds tensors and plain
  containers: no code from the file runs and PyTorch is not needed. Every storage's byte length is
  checked against the zip member that holds it, and every tensor view (offset, sizes, strides)
  against its storage, before any array is made: a malformed file is an error naming the file and
  the tensor, never an out-of-bounds read.
"""
from __future__ import annotations

import contextvars
import json
import os
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy (safetensors' numpy reader needs it)
import numpy as np


class CheckpointFormatError(ValueError):
    """A checkpoint file is malformed (truncated, inconsistent header, a view outside its data).
    The message names the file, and the tensor when one is concerned."""


class CheckpointPickleError(CheckpointFormatError, pickle.UnpicklingError):
    """A ``.pth`` whose pickle is damaged or asks for anything but tensors and plain containers."""


# ------------------------------------------------------------------ header-only checks
class HeadersChecked(BaseException):
    """Raised by :func:`vidax.weights.keymap.load_params` (and :meth:`LazyTensor.read`) inside
    :func:`headers_only`: the loader got as far as reading data, so every file it opened parsed (safetensors headers and
    their data ranges, ``.pth`` pickles against the allow-list and their storages) and, when it came
    from :func:`load_params`, every tensor its key map reads has the expected shape. A
    ``BaseException``, like ``GeneratorExit``: it is control flow, and no loader's ``except
    Exception`` may swallow it."""

    def __init__(self, what: str = ""):
        self.what = what
        super().__init__(what)


_HEADERS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("vidax_headers_only", default=False)


@contextmanager
def headers_only():
    """Within this block, a component loader stops before the first byte of tensor data is read:
    :func:`load_params` checks names and shapes against the key map from the headers, then raises
    :class:`HeadersChecked` (so does any other tensor read). What validation uses to check a whole
    checkpoint folder with each family's own loaders, without loading a weight."""
    token = _HEADERS_ONLY.set(True)
    try:
        yield
    finally:
        _HEADERS_ONLY.reset(token)


def reading_headers_only() -> bool:
    return _HEADERS_ONLY.get()


@dataclass
class LazyTensor:
    """A tensor in a checkpoint: shape and dtype known, data read on :meth:`read`.

    ``_reader()`` returns the whole tensor; ``_slicer(box)``, when given, returns the part of it
    inside ``box`` (a tuple of ``slice(start, stop)``, one per dimension, step 1) reading only that
    part from the file."""

    name: str
    shape: tuple
    dtype: np.dtype
    _reader: Callable[[], np.ndarray]
    _slicer: Callable[[tuple], np.ndarray] | None = None
    file: str | None = None  # the file holding it (for error messages)

    def read(self, index=None) -> np.ndarray:
        """The tensor, or ``tensor[index]`` for a basic numpy index (ints, slices with any step,
        ``...``); a file that supports it (safetensors) reads only the bounding box of ``index``."""
        if reading_headers_only():
            raise HeadersChecked(self.name)
        if index is None:
            arr = self._reader()
            if tuple(arr.shape) != tuple(self.shape):
                raise CheckpointFormatError(
                    f"tensor {self.name!r}: stored data has shape {tuple(arr.shape)}, header says {tuple(self.shape)}")
            return arr
        plan = _box(index, tuple(self.shape))
        if plan is None or self._slicer is None:
            return self.read()[index]
        box, rest = plan
        want = tuple(s.stop - s.start for s in box)
        part = np.empty(want, self.dtype) if 0 in want else self._slicer(box)
        if tuple(part.shape) != want:
            raise CheckpointFormatError(f"tensor {self.name!r}: slice {box} read shape {part.shape}, expected {want}")
        return part[rest]


def _box(index, shape: tuple):
    """``index`` as (bounding box of unit-step slices, index into that box), or None when it is not
    a basic index of ints / slices / one ``...``."""
    idx = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in idx) > 1:
        return None
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * (len(shape) - len(idx) + 1) + idx[k + 1:]
    if len(idx) > len(shape):
        return None
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    box, rest = [], []
    for i, n in zip(idx, shape):
        if isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(f"index {int(i)} is out of bounds for a dimension of size {n}")
            box.append(slice(j, j + 1))
            rest.append(0)
        elif isinstance(i, slice):
            r = range(*i.indices(n))
            if not r:
                box.append(slice(0, 0))
                rest.append(slice(None))
            else:
                lo, hi = min(r[0], r[-1]), max(r[0], r[-1]) + 1
                box.append(slice(lo, hi))
                rest.append(slice(None, None, r.step))
        else:
            return None
    return tuple(box), tuple(rest)


class Checkpoint(Mapping):
    """Read-only mapping ``name -> LazyTensor`` over one or more files."""

    def __init__(self, tensors: dict[str, LazyTensor], source: str):
        self._t = tensors
        self.source = source

    def __getitem__(self, k):
        return self._t[k]

    def __iter__(self):
        return iter(self._t)

    def __len__(self):
        return len(self._t)

    def __repr__(self):
        return f"Checkpoint({self.source!r}, {len(self._t)} tensors)"

    def numpy(self) -> dict[str, np.ndarray]:
        return {k: v.read() for k, v in self._t.items()}


# --------------------------------------------------------------------------- safetensors
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _ST_DTYPES["F8_E8M0"] = ml_dtypes.float8_e8m0fnu


def _numpy_fp8_names() -> None:
    """safetensors' numpy reader looks fp8 dtypes up as attributes of the ``numpy`` module
    (``numpy.float8_e4m3fn``), which numpy does not have (safetensors issue #682); give numpy the
    ``ml_dtypes`` types under those names. Done once, only when a file holds fp8 tensors, and only
    for names numpy lacks."""
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
        if not hasattr(np, name) and hasattr(ml_dtypes, name):
            setattr(np, name, getattr(ml_dtypes, name))


def _safe_open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointFormatError(f"{path}: not a readable safetensors file ({e})") from None


def _safetensors_read(path: Path, name: str, box: tuple | None = None) -> np.ndarray:
    """One tensor (or the part of it in ``box``), opening the file for this read only."""
    try:
        with _safe_open(path) as f:
            return f.get_tensor(name) if box is None else f.get_slice(name)[box]
    except CheckpointFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's errors do not name the file
        raise CheckpointFormatError(f"{path}: tensor {name!r}: {type(e).__name__}: {e}") from None


def _safetensors_file(path: Path) -> dict[str, LazyTensor]:
    out = {}
    with _safe_open(path) as f:
        for name in f.keys():
            view = f.get_slice(name)
            code, shape = view.get_dtype(), tuple(int(d) for d in view.get_shape())
            if code not in _ST_DTYPES:
                raise CheckpointFormatError(f"{path}: tensor {name!r} has unsupported dtype {code}")
            if code.startswith("F8"):
                _numpy_fp8_names()
            out[name] = LazyTensor(name, shape, np.dtype(_ST_DTYPES[code]),
                                   lambda n=name: _safetensors_read(path, n),
                                   lambda box, n=name: _safetensors_read(path, n, box), file=str(path))
    return out


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write host numpy arrays (bf16 / fp8 as ``ml_dtypes``) with ``safetensors.numpy.save_file``;
    the file appears whole or not at all (written aside, then renamed)."""
    from safetensors.numpy import save_file

    arrays = {}
    for name, a in tensors.items():
        a = np.asarray(a)
        arrays[name] = a if a.flags.c_contiguous else a.copy(order="C")  # the library writes raw memory
    tmp = f"{path}.partial"
    save_file(arrays, tmp, metadata={str(k): str(v) for k, v in metadata.items()} if metadata else None)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- .pth (zip)
_TORCH_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "ComplexFloatStorage": np.complex64, "ComplexDoubleStorage": np.complex128,
}
# dtypes named by ``_rebuild_tensor_v3`` (tensors of dtypes without a legacy storage class)
_TORCH_DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "complex64": np.complex64,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
}


class _DType:
    """A numpy dtype standing in for a torch storage class or dtype while unpickling (not callable)."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Frozen:
    """Objects the unpickler builds refuse pickle's BUILD (no state set after construction)."""

    __slots__ = ()

    def __setstate__(self, state):
        raise pickle.UnpicklingError(f"refusing to set state on {type(self).__name__}")


class _Storage(_Frozen):
    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key, dtype: np.dtype, numel):
        self.key, self.dtype, self.numel = key, dtype, numel


class _PendingTensor(_Frozen):
    __slots__ = ("storage", "offset", "size", "stride", "dtype")

    def __init__(self, storage, offset, size, stride, dtype=None):
        self.storage, self.offset, self.size, self.stride, self.dtype = storage, offset, size, stride, dtype


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _PendingTensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    return _PendingTensor(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *args):
    return data


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f, path):
        super().__init__(f)
        self.path = path

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_tensor_v3
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "torch" and name in _TORCH_STORAGE_DTYPES:
            return _DType(_TORCH_STORAGE_DTYPES[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _DType(np.uint8)
        if module == "torch" and name in _TORCH_DTYPES:
            return _DType(_TORCH_DTYPES[name])
        raise CheckpointPickleError(
            f"{self.path}: refusing to load {module}.{name}: only tensors and plain containers are allowed in a checkpoint"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _DType)):
            raise CheckpointPickleError(f"{self.path}: unsupported persistent id {pid!r:.200}")
        _, stype, key, _location, numel = pid
        return _Storage(key, stype.dtype, numel)


def _is_int(x) -> bool:
    return type(x) is int


def _checked_view(path: Path, zf: zipfile.ZipFile, prefix: str, name: str, t: _PendingTensor):
    """Validate one tensor's storage and view; returns (member, storage bytes, dtype, offset, shape,
    strides) as plain values, or raises :class:`CheckpointFormatError` naming file and tensor."""

    def bad(msg):
        return CheckpointFormatError(f"{path}: tensor {name!r}: {msg}")

    s = t.storage
    if not isinstance(s, _Storage) or not isinstance(s.key, str) or not _is_int(s.numel) or s.numel < 0:
        raise bad("malformed storage reference")
    dtype = s.dtype if t.dtype is None else t.dtype.dtype if isinstance(t.dtype, _DType) else None
    if dtype is None:
        raise bad(f"unsupported dtype {t.dtype!r:.80}")
    nbytes = s.numel * s.dtype.itemsize
    member = f"{prefix}data/{s.key}"
    try:
        info = zf.getinfo(member)
    except KeyError:
        raise bad(f"its storage {member!r} is not in the archive") from None
    if info.file_size != nbytes:
        raise bad(f"storage {member!r} holds {info.file_size} bytes; its header says {s.numel} x "
                  f"{s.dtype.name} = {nbytes} bytes")
    offset, size, stride = t.offset, t.size, t.stride
    if not (_is_int(offset) and isinstance(size, tuple) and isinstance(stride, tuple)
            and all(_is_int(d) for d in size) and all(_is_int(d) for d in stride) and len(size) == len(stride)):
        raise bad(f"malformed view (offset {offset!r:.40}, size {size!r:.80}, stride {stride!r:.80})")
    if offset < 0 or any(d < 0 for d in size) or any(d < 0 for d in stride):
        raise bad(f"negative offset, size or stride (offset {offset}, size {list(size)}, stride {list(stride)})")
    elements = nbytes // dtype.itemsize
    if 0 not in size:
        last = offset + sum((d - 1) * st for d, st in zip(size, stride))
        if last >= elements:
            raise bad(f"view (offset {offset}, size {list(size)}, stride {list(stride)}) reaches element {last} "
                      f"of a storage of {elements} {dtype.name} elements ({nbytes} bytes)")
    elif offset > elements:
        raise bad(f"offset {offset} is past the end of its storage ({elements} elements)")
    return member, nbytes, dtype, offset, size, stride


def _read_member(path: Path, zf: zipfile.ZipFile, member: str, nbytes: int, name: str) -> bytearray:
    buf = bytearray(nbytes)
    view, pos = memoryview(buf), 0
    try:
        with zf.open(member) as f:
            while pos < nbytes:
                n = f.readinto(view[pos: pos + (64 << 20)])
                if not n:
                    break
                pos += n
            f.read(1)  # reach the end of the member: zipfile checks its CRC-32 there
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointFormatError(f"{path}: tensor {name!r}: cannot read {member!r} ({e})") from None
    if pos != nbytes:
        raise CheckpointFormatError(f"{path}: tensor {name!r}: {member!r} ended after {pos} of {nbytes} bytes")
    return buf


def _pth_reader(path, zf, name, member, nbytes, dtype, offset, shape, stride):
    def read() -> np.ndarray:
        flat = np.frombuffer(_read_member(path, zf, member, nbytes, name), dtype=dtype, count=nbytes // dtype.itemsize)
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if 0 in shape:
            return np.empty(shape, dtype)
        dense = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
        if all(st == d for st, d, n in zip(stride, dense, shape) if n > 1):  # contiguous (incl. scalars)
            return flat[offset: offset + numel].reshape(shape)
        # bounds were checked against the storage before this file was accepted (_checked_view)
        view = np.lib.stride_tricks.as_strided(flat[offset:], shape=shape, strides=tuple(st * dtype.itemsize for st in stride),
                                               writeable=False)
        return np.ascontiguousarray(view)

    return read


def _pth_tensors(path: Path) -> dict[str, LazyTensor]:
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
        raise CheckpointFormatError(f"{path}: a truncated or damaged zip archive" if zipped else
                                    f"{path}: only the zip-based PyTorch format (torch>=1.6 default) is supported")
    zf = zipfile.ZipFile(path)  # kept open by the tensors' readers
    try:
        return _pth_index(path, zf)
    except BaseException:
        zf.close()
        raise


def _pth_index(path: Path, zf: zipfile.ZipFile) -> dict[str, LazyTensor]:
    pkl = sorted((n for n in zf.namelist() if n.endswith("data.pkl")), key=len)
    if not pkl:
        raise CheckpointFormatError(f"{path}: no data.pkl inside; not a PyTorch checkpoint")
    prefix = pkl[0][: -len("data.pkl")]
    try:
        with zf.open(pkl[0]) as f:
            obj = _RestrictedUnpickler(f, path).load()
    except CheckpointFormatError:
        raise
    except pickle.UnpicklingError as e:
        raise CheckpointPickleError(f"{path}: {e}") from None
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            RecursionError, MemoryError) as e:
        raise CheckpointPickleError(f"{path}: cannot unpickle its data.pkl ({type(e).__name__}: {e})") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    out, seen = {}, set()
    stack = [("", obj)]
    while stack:  # nested dicts -> dotted names (iterative: a pickle may nest deeply or refer to itself)
        pre, o = stack.pop()
        if isinstance(o, _PendingTensor):
            member, nbytes, dtype, offset, shape, stride = _checked_view(path, zf, prefix, pre, o)
            out[pre] = LazyTensor(pre, shape, dtype, _pth_reader(path, zf, pre, member, nbytes, dtype, offset, shape, stride),
                                  file=str(path))
        elif isinstance(o, dict) and id(o) not in seen:
            seen.add(id(o))
            stack.extend((f"{pre}.{k}" if pre else str(k), v) for k, v in reversed(list(o.items())))
    return out


# --------------------------------------------------------------------------- entry point
def open_checkpoint(path: str | os.PathLike, prefix: str | None = None) -> Checkpoint:
    """Open a checkpoint file or folder (a local path, or any fsspec URL: fetched once into the
    local cache, see :func:`vidax.weights.resolve_source`). Inside
    :func:`vidax.weights.lora.merging` for this path, the tensors a LoRA adapts read merged.

    - ``*.safetensors``: one file;
    - ``*.safetensors.index.json``: shards listed in its ``weight_map``;
    - ``*.pth`` / ``*.pt`` / ``*.bin`` / ``*.ckpt``: PyTorch zip archive, restricted unpickling;
    - a folder: its index json if there is one, else every ``*.safetensors`` in it (optionally only
      those whose name starts with ``prefix``).
    """
    from .lora import apply_active

    return apply_active(_open_checkpoint(path, prefix), path)


def _open_checkpoint(path: str | os.PathLike, prefix: str | None = None) -> Checkpoint:
    from .source import is_url, resolve_source

    p = resolve_source(path) if isinstance(path, str) and is_url(path) else Path(path)
    if p.is_dir():
        idx = sorted(p.glob(f"{prefix or ''}*.safetensors.index.json"))
        if idx:
            return _open_checkpoint(idx[0])
        files = sorted(p.glob(f"{prefix or ''}*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in folder {p}")
        tensors = {}
        for f in files:
            tensors.update(_safetensors_file(f))
        return Checkpoint(tensors, str(p))
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    name = p.name
    if name.endswith(".index.json"):
        try:
            weight_map = json.loads(p.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"{p}: not a safetensors index (a JSON object with a weight_map): {e}") from None
        tensors = {}
        for s in shards:
            shard = p.parent / s
            if not shard.is_file():
                raise FileNotFoundError(f"{p}: shard {s} is not in {p.parent}")
            tensors.update(_safetensors_file(shard))
        missing = set(weight_map) - set(tensors)
        if missing:
            raise CheckpointFormatError(
                f"{p}: index lists {len(missing)} tensors not found in its shards, e.g. {sorted(missing)[:3]}")
        return Checkpoint(tensors, str(p))
    if name.endswith(".safetensors"):
        return Checkpoint(_safetensors_file(p), str(p))
    if name.endswith((".pth", ".pt", ".bin", ".ckpt")):
        return Checkpoint(_pth_tensors(p), str(p))
    raise ValueError(f"{p}: unknown checkpoint format (expected .safetensors, .safetensors.index.json, .pth, .pt or .bin)")
