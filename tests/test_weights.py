"""Checkpoint readers and key maps (no model involved)."""
import json
import pickle
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from vidax.weights import (CheckpointFormatError, CheckpointMismatchError, KeyMap, Rule, load_params, open_checkpoint,
                           save_safetensors)


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "a.bias": rng.standard_normal((3,)).astype(np.float32),
        "conv.weight": rng.standard_normal((4, 2, 3, 3, 3)).astype(np.float32),
        "layers.0.w": rng.standard_normal((2, 2)).astype(np.float32),
        "layers.1.w": rng.standard_normal((2, 2)).astype(np.float32),
        "half": rng.standard_normal((4,)).astype(np.float16),
    }


def test_safetensors_roundtrip_matches_reference_library(tmp_path):
    from safetensors.torch import load_file, save_file

    t = _tensors()
    t_torch = {k: torch.from_numpy(v) for k, v in t.items()}
    t_torch["bf16"] = torch.randn(3, 4).to(torch.bfloat16)
    save_file(t_torch, tmp_path / "m.safetensors")
    ck = open_checkpoint(tmp_path / "m.safetensors")
    assert set(ck) == set(t_torch)
    for k, v in t.items():
        np.testing.assert_array_equal(ck[k].read(), v)
    bf = ck["bf16"].read()
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.astype(np.float32), t_torch["bf16"].float().numpy())
    # our writer is readable by the reference library
    save_safetensors(ck.numpy(), tmp_path / "copy.safetensors")
    back = load_file(tmp_path / "copy.safetensors")
    assert torch.equal(back["bf16"], t_torch["bf16"])
    np.testing.assert_array_equal(back["conv.weight"].numpy(), t["conv.weight"])


def test_sharded_index(tmp_path):
    t = _tensors()
    names = sorted(t)
    save_safetensors({k: t[k] for k in names[:3]}, tmp_path / "model-00001-of-00002.safetensors")
    save_safetensors({k: t[k] for k in names[3:]}, tmp_path / "model-00002-of-00002.safetensors")
    wm = {k: ("model-00001-of-00002.safetensors" if k in names[:3] else "model-00002-of-00002.safetensors") for k in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    ck = open_checkpoint(tmp_path)
    assert set(ck) == set(t)
    for k in names:
        np.testing.assert_array_equal(ck[k].read(), t[k])


def test_pth_restricted_unpickler(tmp_path):
    t = {k: torch.from_numpy(v) for k, v in _tensors().items()}
    t["bf16"] = torch.randn(2, 3).to(torch.bfloat16)
    t["strided"] = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous view
    t["param"] = torch.nn.Parameter(torch.ones(2) * 3)
    torch.save(t, tmp_path / "m.pth")
    ck = open_checkpoint(tmp_path / "m.pth")
    assert set(ck) == set(t)
    for k, v in t.items():
        np.testing.assert_array_equal(ck[k].read().astype(np.float32), v.detach().float().numpy(), err_msg=k)


def test_pth_refuses_arbitrary_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "evil.pth", _use_new_zipfile_serialization=True)
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load \w+\.print"):
        open_checkpoint(tmp_path / "evil.pth")


def _map():
    return KeyMap([
        Rule("a.weight", "a.w", "linear"),
        Rule("a.bias", "a.b"),
        Rule("conv.weight", "conv.w", "conv3d"),
        Rule("layers.{i}.w", "layers.w", "linear"),
        Rule("half", "h"),
    ])


def _like():
    from types import SimpleNamespace as S

    f = lambda *s: S(shape=s, dtype=np.float32)
    return {"a": {"w": f(5, 3), "b": f(3)}, "conv": {"w": f(3, 3, 3, 2, 4)}, "layers": {"w": f(2, 2, 2)}, "h": f(4)}


def test_load_params_transposes_stacks_and_casts():
    t = _tensors()
    p = load_params(t, _map(), _like(), dtype=ml_dtypes.bfloat16)
    assert p["a"]["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(p["a"]["w"].astype(np.float32), t["a.weight"].T.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert p["conv"]["w"].shape == (3, 3, 3, 2, 4)
    np.testing.assert_array_equal(p["conv"]["w"][1, 2, 0, 1, 3].astype(np.float32),
                                  t["conv.weight"][3, 1, 1, 2, 0].astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(p["layers"]["w"][1].astype(np.float32),
                                  t["layers.1.w"].T.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_load_params_reports_all_problems_at_once():
    t = _tensors()
    del t["layers.1.w"]
    t["stray"] = np.zeros(1, np.float32)
    t["a.bias"] = np.zeros(4, np.float32)
    with pytest.raises(CheckpointMismatchError) as e:
        load_params(t, _map(), _like(), what="toy model")
    msg = str(e.value)
    assert "toy model" in msg
    assert "1 missing: layers.1.w" in msg
    assert "1 unexpected: stray" in msg
    assert "1 mis-shaped: a.bias (shape [4], expected [3])" in msg


def test_rename_between_formats():
    a = _map()
    b = KeyMap([Rule(r.src.replace("layers.", "blocks.").replace("a.", "alpha."), r.dst, r.kind) for r in a.rules])
    ren = a.rename(_tensors(), b)
    assert ren["layers.1.w"] == "blocks.1.w"
    assert ren["a.weight"] == "alpha.weight"


# ------------------------------------------------------------------ safetensors through the library
def test_fp8_bf16_and_sliced_reads(tmp_path):
    rng = np.random.default_rng(1)
    t = {
        "w": rng.standard_normal((6, 10)).astype(np.float32),
        "bf": rng.standard_normal((4, 5, 3)).astype(ml_dtypes.bfloat16),
        "e4": rng.standard_normal((8, 4)).astype(ml_dtypes.float8_e4m3fn),
        "e5": rng.standard_normal((7,)).astype(ml_dtypes.float8_e5m2),
        "scalar": np.array(2.5, np.float32),
        "strided": np.arange(12, dtype=np.int32).reshape(3, 4).T,  # written C-ordered
    }
    save_safetensors(t, tmp_path / "m.safetensors", metadata={"format": "np"})
    ck = open_checkpoint(tmp_path / "m.safetensors")
    for k, v in t.items():
        got = ck[k].read()
        assert got.dtype == v.dtype and got.shape == v.shape == ck[k].shape, k
        np.testing.assert_array_equal(got.astype(np.float32), v.astype(np.float32), err_msg=k)
    # the reference library reads our file (fp8 and bf16 included)
    from safetensors.torch import load_file

    back = load_file(tmp_path / "m.safetensors")
    assert back["e4"].dtype == torch.float8_e4m3fn and back["scalar"].shape == ()
    np.testing.assert_array_equal(back["e4"].float().numpy(), t["e4"].astype(np.float32))
    # slices: ints, negative steps, ellipsis, empty, and what a mesh asks for (tuples of slices)
    full = ck["bf"].read()
    for idx in [(slice(1, 3),), (slice(None), slice(2, 5), slice(0, 2)), (2, slice(None, None, -2)), (..., 1),
                (slice(3, 1),), (-1, ..., slice(1, None)), slice(None, None, 3), 0]:
        np.testing.assert_array_equal(ck["bf"].read(index=idx).astype(np.float32), full[idx].astype(np.float32),
                                      err_msg=str(idx))
    np.testing.assert_array_equal(ck["e4"].read(index=(slice(4, 8), slice(0, 2))).astype(np.float32),
                                  t["e4"][4:8, 0:2].astype(np.float32))
    with pytest.raises(IndexError):
        ck["w"].read(index=(6,))


def test_sliced_reads_read_only_their_part(tmp_path):
    """A mesh placing a checkpoint tensor reads each device's block from the file, never the whole."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from vidax.core.sharding import place

    w = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
    save_safetensors({"w": w}, tmp_path / "m.safetensors")
    lt = open_checkpoint(tmp_path / "m.safetensors")["w"]
    boxes = []
    slicer = lt._slicer
    lt._slicer = lambda box: boxes.append(box) or slicer(box)
    lt._reader = lambda: pytest.fail("the whole tensor was read")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    arr = place({"w": lt}, {"w": NamedSharding(mesh, P("a", "b"))})["w"]
    np.testing.assert_array_equal(np.asarray(arr), w)
    assert len(boxes) >= 4 and {tuple(s.stop - s.start for s in b) for b in boxes} == {(4, 3)}


@pytest.mark.parametrize("cut", [4, 8, 40, -1])
def test_truncated_safetensors_names_the_file(tmp_path, cut):
    save_safetensors(_tensors(), tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    bad = tmp_path / "model-00001-of-00001.safetensors"
    bad.write_bytes(data[:cut])
    with pytest.raises(CheckpointFormatError, match=re.escape(str(bad))):
        open_checkpoint(bad)
    with pytest.raises(CheckpointFormatError, match=re.escape(str(bad))):
        open_checkpoint(tmp_path)  # through a folder too


def test_safetensors_header_lying_about_a_shape(tmp_path):
    """A header whose shape does not match its byte range is refused, naming the file."""
    save_safetensors({"a": np.zeros((2, 3), np.float32)}, tmp_path / "m.safetensors")
    data = (tmp_path / "m.safetensors").read_bytes()
    fixed = data.replace(b'"shape":[2,3]', b'"shape":[3,3]')
    assert fixed != data
    (tmp_path / "m.safetensors").write_bytes(fixed)
    with pytest.raises(CheckpointFormatError, match=r"m\.safetensors"):
        open_checkpoint(tmp_path / "m.safetensors")


# ------------------------------------------------------------------ bounds-checked .pth
class _T:
    """A tensor to pickle the way torch does: storage key, offset, size, stride."""

    def __init__(self, key, offset, size, stride, dtype=None, state=None):
        self.key, self.offset, self.size, self.stride, self.dtype = key, offset, size, stride, dtype
        self.state = state  # pickled as BUILD state set on the rebuilt tensor


def _craft_pth(path, tensors: dict, storages: dict):
    """A torch-format zip written by hand. ``storages``: key -> (torch storage class, numel, bytes)."""
    import collections
    import io
    import zipfile

    class P(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, _T):
                args = (("S", obj.key), obj.offset, tuple(obj.size), tuple(obj.stride), False, collections.OrderedDict())
                if obj.dtype is not None:
                    return torch._utils._rebuild_tensor_v3, args + (obj.dtype,), obj.state
                return torch._utils._rebuild_tensor_v2, args, obj.state
            return NotImplemented

        def persistent_id(self, obj):
            if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "S":
                cls, numel, _ = storages[obj[1]]
                return ("storage", cls, obj[1], "cpu", numel)
            return None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(collections.OrderedDict(tensors))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        for key, (_, _, data) in storages.items():
            if data is not None:  # None: a storage the pickle names but the archive lacks
                z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")


def test_crafted_pth_reads_views(tmp_path):
    """The hand-written format is the real one: contiguous, offset, transposed and fp8 views read back."""
    data = np.arange(12, dtype=np.float32)
    e4 = np.arange(6, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    _craft_pth(tmp_path / "m.pth",
               {"a": _T("0", 0, (3, 4), (4, 1)), "b": _T("0", 2, (2, 3), (1, 4)), "s": _T("0", 5, (), ()),
                "e": _T("1", 1, (2, 2), (2, 1), torch.float8_e4m3fn), "empty": _T("0", 12, (0, 4), (4, 1))},
               {"0": (torch.FloatStorage, 12, data.tobytes()),
                "1": (torch.storage.UntypedStorage, 6, e4.tobytes())})
    ck = open_checkpoint(tmp_path / "m.pth")
    np.testing.assert_array_equal(ck["a"].read(), data.reshape(3, 4))
    np.testing.assert_array_equal(ck["b"].read(), np.lib.stride_tricks.as_strided(data[2:], (2, 3), (4, 16)))
    assert ck["s"].read().shape == () and ck["s"].read() == 5
    assert ck["e"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(ck["e"].read().astype(np.float32), [[1, 2], [3, 4]])
    assert ck["empty"].read().shape == (0, 4)
    np.testing.assert_array_equal(ck["a"].read(index=(slice(1, 3), 2)), data.reshape(3, 4)[1:3, 2])
    # torch reads the same file the same way
    ref = torch.load(tmp_path / "m.pth", weights_only=True)
    np.testing.assert_array_equal(ref["b"].numpy(), ck["b"].read())


@pytest.mark.parametrize("tensor,storage,msg", [
    (_T("0", 10, (2, 2), (2, 1)), (12, 48), r"reaches element 13 of a storage of 12 float32 elements"),
    (_T("0", 0, (3, 4), (5, 1)), (12, 48), r"reaches element 13 of a storage of 12"),
    (_T("0", 0, (3, 4), (4, 1)), (12, 40), r"holds 40 bytes; its header says 12 x float32 = 48 bytes"),
    (_T("0", 0, (3, 4), (4, 1)), (1 << 40, 48), r"holds 48 bytes"),
    (_T("0", -1, (2,), (1,)), (12, 48), r"negative offset"),
    (_T("0", 0, (2,), (-1,)), (12, 48), r"negative offset, size or stride"),
    (_T("0", 0, (2, 2), (1,)), (12, 48), r"malformed view"),
    (_T("0", 0, (2,), (1,)), (12, None), r"storage 'archive/data/0' is not in the archive"),
])
def test_pth_out_of_range_views_are_refused(tmp_path, tensor, storage, msg):
    numel, nbytes = storage
    path = tmp_path / "bad.pth"
    _craft_pth(path, {"enc.w": tensor}, {"0": (torch.FloatStorage, numel, None if nbytes is None else bytes(nbytes))})
    with pytest.raises(CheckpointFormatError, match=re.escape(str(path)) + r": tensor 'enc\.w': .*" + msg):
        open_checkpoint(path).numpy()


def test_pth_cannot_change_a_view_after_it_is_built(tmp_path):
    """Pickle's BUILD could reset a tensor's offset after its construction: refused."""
    path = tmp_path / "m.pth"
    _craft_pth(path, {"w": _T("0", 0, (2,), (1,), state={"offset": 10**9})}, {"0": (torch.FloatStorage, 2, bytes(8))})
    with pytest.raises(pickle.UnpicklingError, match=r"m\.pth: refusing to set state"):
        open_checkpoint(path)


def test_pth_with_corrupt_storage_bytes(tmp_path):
    """A storage whose bytes were changed after writing fails its CRC: an error, not garbage."""
    torch.save({"w": torch.arange(64.0)}, tmp_path / "m.pth")
    data = bytearray((tmp_path / "m.pth").read_bytes())
    i = data.find(np.arange(64, dtype=np.float32)[10:12].tobytes())
    data[i] ^= 0xFF
    (tmp_path / "m.pth").write_bytes(bytes(data))
    ck = open_checkpoint(tmp_path / "m.pth")
    with pytest.raises(CheckpointFormatError, match=r"m\.pth: tensor 'w': cannot read .*CRC"):
        ck["w"].read()


def test_truncated_pth_names_the_file(tmp_path):
    torch.save({"w": torch.ones(1000)}, tmp_path / "m.pth")
    data = (tmp_path / "m.pth").read_bytes()
    (tmp_path / "m.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match=r"m\.pth"):
        open_checkpoint(tmp_path / "m.pth").numpy()
