"""WAV (RIFF, 16-bit PCM) bytes, for the stage's audio/wav Blob and the clients'
growing files: one header layout in one place. No numpy needed to read it."""

from __future__ import annotations

import struct

import numpy as np

MEDIA_TYPE = "audio/wav"


def header(sample_rate: int, channels: int, data_bytes: int) -> bytes:
    """The 44-byte header of a 16-bit PCM WAV whose samples take ``data_bytes``."""
    block = channels * 2
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + data_bytes,
        b"WAVE",
        b"fmt ",
        16,
        1,  # PCM
        channels,
        sample_rate,
        sample_rate * block,
        block,
        16,
        b"data",
        data_bytes,
    )


def pcm16(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] as little-endian 16-bit PCM (clipped), as hibari writes them."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
