"""The speech engine: hibari text to speech, sentence by sentence (engine.py),
its settings (config.py), incremental text (text.py), a loaded voice (voice.py)."""

from services.engines.speech.engine import SpeechEngine

__all__ = ["SpeechEngine"]
