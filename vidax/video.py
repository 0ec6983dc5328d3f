"""Frames -> H.264 mp4 through the ffmpeg binary that imageio-ffmpeg ships."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def write_mp4(frames: np.ndarray, path: str | os.PathLike, fps: float = 16.0, crf: int = 18) -> Path:
    """Write uint8 frames [F, H, W, 3] as H.264 (yuv420p). Odd sizes are padded to even by
    repeating the last row/column. Written to a temporary name and renamed, so a partial file
    never looks complete."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    f, h, w, _ = frames.shape
    ph, pw = h % 2, w % 2
    if ph or pw:
        frames = np.pad(frames, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
        h, w = h + ph, w + pw
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.mp4")
    cmd = [
        ffmpeg_exe(), "-y", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}",
        "-r", str(fps), "-i", "-", "-an", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", str(crf),
        "-movflags", "+faststart", str(tmp),
    ]
    proc = subprocess.run(cmd, input=np.ascontiguousarray(frames).tobytes(), capture_output=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"ffmpeg failed writing {path}: {proc.stderr.decode(errors='replace').strip()}")
    os.replace(tmp, path)
    return path


def read_mp4(path: str | os.PathLike) -> np.ndarray:
    """Decode an mp4 to uint8 frames [F, H, W, 3] (for checks and previews)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    frames = [np.frombuffer(fr, np.uint8).reshape(h, w, 3) for fr in reader]
    return np.stack(frames) if frames else np.zeros((0, h, w, 3), np.uint8)


def write_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """Write a uint8 RGB image [H, W, 3] as PNG (through ffmpeg)."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    h, w, _ = image.shape
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial.png")
    cmd = [ffmpeg_exe(), "-y", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}",
           "-i", "-", "-frames:v", "1", "-f", "image2", "-c:v", "png", str(tmp)]
    proc = subprocess.run(cmd, input=np.ascontiguousarray(image).tobytes(), capture_output=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"ffmpeg failed writing {path}: {proc.stderr.decode(errors='replace').strip()}")
    os.replace(tmp, path)
    return path
