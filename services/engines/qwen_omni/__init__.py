"""Qwen3-Omni as three stage engines (one per part, each loading only its
weights): the thinker (text, images, audio in; tokens and the talker's
hand-off out), the talker (codec codes, step by step) and code2wav (audio,
chunk by chunk). handoff.py builds the talker's input as the monolithic model
does; tiny.py builds a random tiny checkpoint for tests and this machine."""

from services.engines.qwen_omni.code2wav import QwenOmniCode2Wav
from services.engines.qwen_omni.talker import QwenOmniTalker
from services.engines.qwen_omni.thinker import QwenOmniThinker

__all__ = ["QwenOmniCode2Wav", "QwenOmniTalker", "QwenOmniThinker"]
