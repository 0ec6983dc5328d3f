"""Media in and out through imageio: frames -> H.264 mp4 (with an optional AAC audio track),
PNG previews, and reading videos back. The ffmpeg binary is the one imageio-ffmpeg ships."""
from __future__ import annotations

import os
import tempfile
import warnings
import wave
from pathlib import Path

import numpy as np

# ffmpeg runs in a child process that execs right after the fork; JAX's fork warning does not
# apply to it.
warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial" + path.suffix)


def write_mp4(frames, path: str | os.PathLike, fps: float = 16.0, crf: int = 18, audio: np.ndarray | None = None,
              sample_rate: int | None = None) -> Path:
    """Write uint8 frames [F, H, W, 3] (an array or any iterable of [H, W, 3] frames, streamed to
    the encoder) as H.264 (yuv420p). Odd sizes are padded to even by repeating the last row /
    column. ``audio``: float waveform [channels, samples] in [-1, 1] at ``sample_rate``, muxed as
    AAC. Written to a temporary name and renamed, so a partial file never looks complete."""
    import imageio.v3 as iio

    if audio is not None:
        audio = np.asarray(audio, np.float32)
        if audio.ndim != 2 or not sample_rate or sample_rate <= 0:
            raise ValueError(f"audio must be [channels, samples] with a sample rate, got {list(audio.shape)} "
                             f"at {sample_rate!r} Hz")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(path)
    wav = None
    try:
        kw = dict(fps=float(fps), codec="libx264", quality=None, macro_block_size=1, pixelformat="yuv420p",
                  output_params=["-crf", str(crf), "-movflags", "+faststart"], ffmpeg_log_level="error")
        if audio is not None:
            fd, wav = tempfile.mkstemp(suffix=".wav", prefix="vidax-audio-")
            os.close(fd)
            write_wav(audio, sample_rate, wav)
            kw.update(audio_path=wav, audio_codec="aac")
        n = 0
        with iio.imopen(tmp, "w", plugin="FFMPEG", extension=".mp4") as f:
            writer = f.legacy_get_writer(**kw)
            try:
                for frame in frames:
                    frame = np.asarray(frame)
                    if frame.ndim != 3 or frame.shape[-1] != 3 or frame.dtype != np.uint8:
                        raise ValueError(f"frames must be uint8 [F, H, W, 3], got a {frame.dtype} frame "
                                         f"{list(frame.shape)}")
                    ph, pw = frame.shape[0] % 2, frame.shape[1] % 2
                    if ph or pw:
                        frame = np.pad(frame, ((0, ph), (0, pw), (0, 0)), mode="edge")
                    writer.append_data(frame)
                    n += 1
            finally:
                writer.close()
        if n == 0:
            raise ValueError("no frames to write")
        os.replace(tmp, path)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if wav is not None:
            os.unlink(wav)
    return path


def write_wav(audio: np.ndarray, sample_rate: int, path: str | os.PathLike) -> None:
    """Float waveform [channels, samples] in [-1, 1] -> 16-bit PCM WAV."""
    a = np.clip(np.asarray(audio, np.float32), -1.0, 1.0)
    pcm = np.round(a.T * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(a.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.tobytes())


def read_mp4(path: str | os.PathLike) -> np.ndarray:
    """Decode a video to uint8 frames [F, H, W, 3] (for checks and previews)."""
    import imageio.v3 as iio

    return np.asarray(iio.imread(Path(path), plugin="FFMPEG"))


def write_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """Write a uint8 RGB image [H, W, 3] as PNG (Pillow through imageio, no ffmpeg)."""
    import imageio.v3 as iio

    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(path)
    try:
        iio.imwrite(tmp, image, extension=".png")
        os.replace(tmp, path)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    return path
