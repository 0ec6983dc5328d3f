"""Conditioning images: imageio decoding from paths and fsspec URLs, fully decoded at validation."""
import io
import uuid

import fsspec
import numpy as np
import PIL.Image
import pytest

from stages import cli
from stages.images import ImageError, image_size, load_image


def _ref_rgb(path) -> np.ndarray:
    """The reference's loading: alpha composited on white, RGB."""
    im = PIL.Image.open(path)
    im.load()
    if im.mode in ("RGBA", "LA", "P"):
        im = im.convert("RGBA")
        im = PIL.Image.alpha_composite(PIL.Image.new("RGBA", im.size, (255, 255, 255, 255)), im)
    return np.asarray(im.convert("RGB"))


@pytest.fixture
def rgba(tmp_path):
    rng = np.random.default_rng(0)
    a = (rng.random((20, 30, 4)) * 255).astype(np.uint8)
    p = tmp_path / "rgba.png"
    PIL.Image.fromarray(a).save(p)
    return p


def test_alpha_is_composited_on_white(tmp_path, rgba):
    got = load_image(str(rgba))
    assert got.shape == (20, 30, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, _ref_rgb(rgba))
    # a palette image with a transparent entry, grey + alpha, 16-bit grey, a JPEG, a GIF's first frame
    rgb = np.asarray(PIL.Image.open(rgba).convert("RGB"))
    PIL.Image.fromarray(rgb).quantize(16).save(tmp_path / "p.png", transparency=3)
    PIL.Image.fromarray(rgb).convert("LA").save(tmp_path / "la.png")
    PIL.Image.fromarray(rgb).save(tmp_path / "c.jpg", quality=95)
    for name in ("p.png", "la.png", "c.jpg"):
        np.testing.assert_array_equal(load_image(str(tmp_path / name)), _ref_rgb(tmp_path / name), err_msg=name)
    g16 = (np.random.default_rng(1).random((10, 12)) * 65535).astype(np.uint16)
    PIL.Image.fromarray(g16).save(tmp_path / "g16.png")
    got = load_image(str(tmp_path / "g16.png"))
    np.testing.assert_array_equal(got, np.repeat(np.round(g16 / 257.0).astype(np.uint8)[..., None], 3, -1))
    frames = [PIL.Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (10, 200)]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:])
    assert load_image(str(tmp_path / "a.gif")).shape == (8, 8, 3)


def test_exif_orientation_is_applied(tmp_path):
    im = PIL.Image.fromarray(np.zeros((10, 20, 3), np.uint8))
    exif = im.getexif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed 20 high, 10 wide
    im.save(tmp_path / "r.jpg", exif=exif)
    assert image_size(str(tmp_path / "r.jpg")) == (20, 10)


def test_images_from_a_url(rgba):
    url = f"memory://img-{uuid.uuid4().hex[:8]}/first frame.png"
    fsspec.filesystem("memory").pipe_file(url, rgba.read_bytes())
    np.testing.assert_array_equal(load_image(url), _ref_rgb(rgba))
    assert image_size(url) == (20, 30)


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_truncated_image_is_refused_naming_the_file(tmp_path, capsys, fmt):
    buf = io.BytesIO()
    PIL.Image.fromarray((np.random.default_rng(2).random((64, 64, 3)) * 255).astype(np.uint8)).save(buf, fmt)
    data = buf.getvalue()
    bad = tmp_path / f"cut.{fmt}"
    bad.write_bytes(data[: len(data) * 2 // 3])
    with PIL.Image.open(bad) as im:  # the header alone reads fine: only a full decode finds it
        assert im.size == (64, 64)
    with pytest.raises(ImageError, match=f"{bad}: cannot read it as an image .*truncated"):
        image_size(str(bad))
    store = tmp_path / "store"
    rc = cli.main(["generate", "--store", str(store), "--prompt", "x", "--model", "wan2.1-i2v-480p", "--image", str(bad)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"vidax: error: image: {bad}: cannot read it as an image"), err
    assert not (store / "runs").exists()


def test_missing_image_names_it(tmp_path):
    with pytest.raises(ImageError, match=f"{tmp_path / 'nope.png'}: cannot read"):
        load_image(str(tmp_path / "nope.png"))
