"""Checkpoint readers: safetensors (single file or sharded) and PyTorch ``.pth`` zip archives.

Everything is read lazily, tensor by tensor, into host numpy. ``.pth`` files are opened with a
restricted unpickler that only rebuilds tensors and plain containers: no arbitrary code runs and
PyTorch is not needed.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


@dataclass
class LazyTensor:
    """A tensor in a checkpoint: shape and dtype known, data read on ``read()``."""

    name: str
    shape: tuple
    dtype: np.dtype
    _reader: Callable[[], np.ndarray]

    def read(self) -> np.ndarray:
        arr = self._reader()
        if tuple(arr.shape) != tuple(self.shape):
            raise ValueError(f"tensor {self.name!r}: stored data has shape {arr.shape}, header says {self.shape}")
        return arr


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

    def numpy(self) -> dict[str, np.ndarray]:
        return {k: v.read() for k, v in self._t.items()}


# --------------------------------------------------------------------------- safetensors
def _safetensors_tensors(path: Path) -> dict[str, LazyTensor]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        except KeyError:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}") from None
        shape = tuple(info["shape"])
        start, end = info["data_offsets"]

        def reader(start=start, end=end, dtype=dtype, shape=shape):
            count = (end - start) // dtype.itemsize
            mm = np.memmap(path, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,)) if end > start else np.zeros(0, np.uint8)
            return np.frombuffer(mm.tobytes(), dtype=dtype, count=count).reshape(shape)

        out[name] = LazyTensor(name, shape, dtype, reader)
    return out


# --------------------------------------------------------------------------- .pth (zip)
_TORCH_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class _StorageType:
    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)


class _Storage:
    def __init__(self, zf: zipfile.ZipFile, member: str, dtype, numel: int):
        self.zf, self.member, self.dtype, self.numel = zf, member, np.dtype(dtype), numel

    def array(self) -> np.ndarray:
        return np.frombuffer(self.zf.read(self.member), dtype=self.dtype, count=self.numel)


class _PendingTensor:
    def __init__(self, storage: _Storage, offset, size, stride):
        self.storage, self.offset, self.shape, self.stride = storage, offset, tuple(size), tuple(stride)

    def read(self) -> np.ndarray:
        flat = self.storage.array()
        if not self.shape:
            return flat[self.offset].copy()
        isz = flat.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[self.offset:], shape=self.shape, strides=tuple(s * isz for s in self.stride)
        )
        return np.ascontiguousarray(view)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return _PendingTensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *args):
    return data


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f, zf, prefix):
        super().__init__(f)
        self.zf, self.prefix = zf, prefix

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "torch" and name in _TORCH_STORAGE_DTYPES:
            return _StorageType(_TORCH_STORAGE_DTYPES[name])
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: only tensors and plain containers are allowed in a checkpoint"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        dtype = stype.dtype if isinstance(stype, _StorageType) else np.uint8
        return _Storage(self.zf, f"{self.prefix}data/{key}", dtype, numel)


def _pth_tensors(path: Path) -> dict[str, LazyTensor]:
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: only the zip-based PyTorch format (torch>=1.6 default) is supported")
    zf = zipfile.ZipFile(path)
    pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
    if not pkl:
        raise ValueError(f"{path}: no data.pkl inside; not a PyTorch checkpoint")
    prefix = pkl[0][: -len("data.pkl")]
    with zf.open(pkl[0]) as f:
        obj = _RestrictedUnpickler(f, zf, prefix).load()
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
    out = {}

    def walk(o, pre):
        if isinstance(o, _PendingTensor):
            out[pre] = LazyTensor(pre, o.shape, o.storage.dtype, o.read)
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{pre}.{k}" if pre else str(k))

    walk(obj, "")
    return out


# --------------------------------------------------------------------------- entry point
def open_checkpoint(path: str | os.PathLike, prefix: str | None = None) -> Checkpoint:
    """Open a checkpoint file or folder.

    - ``*.safetensors``: one file;
    - ``*.safetensors.index.json``: shards listed in its ``weight_map``;
    - ``*.pth`` / ``*.pt`` / ``*.bin``: PyTorch zip archive, restricted unpickling;
    - a folder: its index json if there is one, else every ``*.safetensors`` in it (optionally only
      those whose name starts with ``prefix``).
    """
    p = Path(path)
    if p.is_dir():
        idx = sorted(p.glob(f"{prefix or ''}*.safetensors.index.json"))
        if idx:
            return open_checkpoint(idx[0])
        files = sorted(p.glob(f"{prefix or ''}*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in folder {p}")
        tensors = {}
        for f in files:
            tensors.update(_safetensors_tensors(f))
        return Checkpoint(tensors, str(p))
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    name = p.name
    if name.endswith(".index.json"):
        index = json.loads(p.read_text())
        shards = sorted(set(index["weight_map"].values()))
        tensors = {}
        for s in shards:
            tensors.update(_safetensors_tensors(p.parent / s))
        missing = set(index["weight_map"]) - set(tensors)
        if missing:
            raise ValueError(f"{p}: index lists {len(missing)} tensors not found in its shards, e.g. {sorted(missing)[:3]}")
        return Checkpoint(tensors, str(p))
    if name.endswith(".safetensors"):
        return Checkpoint(_safetensors_tensors(p), str(p))
    if name.endswith((".pth", ".pt", ".bin", ".ckpt")):
        return Checkpoint(_pth_tensors(p), str(p))
    raise ValueError(f"{p}: unknown checkpoint format (expected .safetensors, .safetensors.index.json, .pth, .pt or .bin)")


def save_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write a safetensors file from host numpy arrays (used by tests and conversion tools)."""
    rev = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        b = arr.tobytes()
        header[name] = {"dtype": rev[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = f"{path}.partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)
