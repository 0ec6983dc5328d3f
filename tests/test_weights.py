"""Checkpoint readers and key maps (no model involved)."""
import json
import pickle

import ml_dtypes
import numpy as np
import pytest
import torch

from vidax.weights import CheckpointMismatchError, KeyMap, Rule, load_params, open_checkpoint, save_safetensors


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
