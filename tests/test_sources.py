"""Checkpoint sources: local paths and fsspec URLs fetched once into the content-addressed cache;
a Wan checkpoint folder on a (emulated) GCS bucket generates a video and is fetched only once."""
import json
import uuid

import fsspec
import numpy as np
import pytest

from vidax.weights import open_checkpoint, resolve_source, save_safetensors
from vidax.weights import source as S


def _memory_folder(tmp_path, files: dict[str, bytes]) -> str:
    url = f"memory://ck-{uuid.uuid4().hex[:8]}/model"
    fs = fsspec.filesystem("memory")
    for rel, data in files.items():
        fs.pipe_file(f"{url}/{rel}", data)
    return url


def test_local_paths_are_returned_as_they_are(tmp_path):
    assert resolve_source(tmp_path) == tmp_path
    assert resolve_source(f"file://{tmp_path}") == tmp_path


def test_remote_folder_is_fetched_once_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "cache"))
    url = _memory_folder(tmp_path, {"config.json": b"{}", "sub/w.bin": b"x" * 1000})
    seen = []
    a = resolve_source(url, progress=seen.append)
    assert a.parent == tmp_path / "cache" / "checkpoints"
    assert (a / "sub" / "w.bin").read_bytes() == b"x" * 1000 and (a / "config.json").read_bytes() == b"{}"
    assert seen[-1].done == seen[-1].total == 1002 and seen[-1].files_done == 2
    real, fetches = S._fetch, []
    monkeypatch.setattr(S, "_fetch", lambda *a, **k: fetches.append(a))
    assert resolve_source(url, progress=seen.append) == a and not fetches  # cached: nothing fetched
    monkeypatch.setattr(S, "_fetch", real)
    # a changed object: a new entry (the key is the listing's sizes and checksums, not the URL)
    fsspec.filesystem("memory").pipe_file(f"{url}/sub/w.bin", b"y" * 1000)
    b = resolve_source(url, progress=lambda p: None)
    assert b != a and (b / "sub" / "w.bin").read_bytes() == b"y" * 1000
    assert json.loads((b.parent / f"{b.name}.json").read_text())["url"] == url
    # only some files: a snapshot of their own
    c = resolve_source(url, include=["*.json"], progress=lambda p: None)
    assert sorted(p.name for p in c.rglob("*") if p.is_file()) == ["config.json"]


def test_interrupted_fetch_never_looks_complete(tmp_path, monkeypatch):
    url = _memory_folder(tmp_path, {"a.bin": b"1" * 10, "b.bin": b"2" * 10})
    calls = []
    real = S._verify

    def flaky(u, f, dst):
        calls.append(f.rel)
        if f.rel == "b.bin":
            raise OSError("connection reset")
        real(u, f, dst)

    monkeypatch.setattr(S, "_verify", flaky)
    with pytest.raises(OSError, match="connection reset"):
        resolve_source(url, cache=tmp_path, progress=lambda p: None)
    assert calls == ["a.bin", "b.bin"]
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no entry, no leftovers
    monkeypatch.setattr(S, "_verify", real)
    got = resolve_source(url, cache=tmp_path, progress=lambda p: None)
    assert (got / "b.bin").read_bytes() == b"2" * 10


def test_size_mismatch_is_refused(tmp_path, monkeypatch):
    url = _memory_folder(tmp_path, {"a.bin": b"1" * 10})
    real = S.list_source

    def lying(u):
        kind, files = real(u)
        return kind, [S.RemoteFile(f.rel, f.path, f.size + 1, f.checksum) for f in files]

    monkeypatch.setattr(S, "list_source", lying)
    with pytest.raises(OSError, match=r"a\.bin: fetched 10 bytes, the listing says 11"):
        resolve_source(url, cache=tmp_path, progress=lambda p: None)


def test_open_checkpoint_from_a_url(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "cache"))
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_safetensors({"w": w}, tmp_path / "m.safetensors")
    url = _memory_folder(tmp_path, {"m.safetensors": (tmp_path / "m.safetensors").read_bytes()})
    np.testing.assert_array_equal(open_checkpoint(url)["w"].read(), w)  # the folder
    np.testing.assert_array_equal(open_checkpoint(f"{url}/m.safetensors")["w"].read(), w)  # one file
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        resolve_source(f"{url}-missing")


# ------------------------------------------------------------------ a Wan checkpoint on GCS
def _tiny_wan_diffusers(folder):
    """A complete tiny Wan2.1 diffusers pipeline folder (tokenizer, UMT5, DiT, VAE, scheduler)."""
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from tests.refutil import perturb

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator(["a red panda in a canoe", "a lighthouse in a storm"] * 20,
                            trainers.UnigramTrainer(vocab_size=40, special_tokens=["<pad>", "</s>", "<unk>"],
                                                    unk_token="<unk>"))
    torch.manual_seed(0)
    text = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
        feed_forward_proj="gated-gelu"))
    dit = perturb(WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=64), seed=1)
    vae = perturb(AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[False, True, True]), seed=2)
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    num_train_timesteps=1000, flow_shift=3.0)
    WanPipeline(tokenizer=transformers.T5Tokenizer(tokenizer_object=tok, extra_ids=0), text_encoder=text,
                transformer=dit, vae=vae, scheduler=sched).save_pretrained(folder)


def test_gcs_checkpoint_generates_and_is_fetched_once(gcs_emulator, monkeypatch, tmp_path, capsys):
    from stages import cli
    from stages import run as R
    from stages.request import Request, validate
    from vidax.video import read_mp4

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    monkeypatch.setenv("VIDAX_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "Wan-tiny"
    _tiny_wan_diffusers(local)
    url = "gs://vidax-test/models/Wan-tiny"
    fs, root = S.filesystem(url)
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(f), f"{root}/{f.relative_to(local).as_posix()}")

    # GCS lists md5 checksums: the same objects under another prefix have the same cache key
    fs.put_file(str(local / "model_index.json"), "vidax-test/elsewhere/model_index.json")
    only = lambda u: [f for f in S.list_source(u)[1] if f.rel == "model_index.json"]  # noqa: E731
    assert S.snapshot_key(only(url)) == S.snapshot_key(only("gs://vidax-test/elsewhere"))

    fetched = []
    real = S._fetch
    monkeypatch.setattr(S, "_fetch", lambda u, files, *a: fetched.append([f.rel for f in files]) or real(u, files, *a))
    common = ["--model", "wan2.1-t2v-1.3b", "--checkpoint", url, "--prompt", "a red panda in a canoe", "--height", "32",
              "--width", "32", "--frames", "5", "--steps", "2", "--store", str(tmp_path / "runs")]
    assert cli.main(["generate", *common, "--run-id", "first"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert f"vidax: fetching {url}" in err  # progress on stderr
    assert read_mp4(tmp_path / "runs" / "runs" / "first" / "video.mp4").shape == (5, 32, 32, 3)
    # validation fetched the configs alone; the weights came once, with the first stage that needed them
    assert len(fetched) == 2 and all(r.endswith(".json") for r in fetched[0]) and len(fetched[1]) > len(fetched[0])
    assert any(r.startswith("transformer/") and r.endswith(".safetensors") for r in fetched[1])

    # a second run (another seed: every stage recomputes) reads the cache: nothing is fetched
    assert cli.main(["generate", *common, "--run-id", "second", "--seed", "1"]) == 0
    assert len(fetched) == 2 and "fetching" not in capsys.readouterr().err

    # the cached copy has the content fingerprints of the local folder: the same stage keys
    def keys(ckpt):
        req = validate(Request(model="wan2.1-t2v-1.3b", checkpoint=ckpt, prompt="x", height=32, width=32,
                               num_frames=5, steps=2))
        return R.stage_keys(req, R.make_pipeline(req))

    assert keys(url) == keys(str(local))
    # a missing folder is one line naming the field, nothing downloaded
    assert cli.main(["generate", *common[:2], "--checkpoint", url + "-missing", *common[4:]]) == 2
    assert capsys.readouterr().err.startswith(f"vidax: error: checkpoint: '{url}-missing': no such folder")
