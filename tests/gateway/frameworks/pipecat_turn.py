"""One turn through Pipecat's OpenAIRealtimeLLMService at its defaults:
BASE_URL INSTRUCTIONS PROMPT [WAV]. With a WAV (24 kHz mono PCM16) the question is
spoken (and input transcription asked for, to check what was heard): its audio
goes in as InputAudioRawFrames in 20 ms pieces at the pace of speech, then two
seconds of silence, and the server's VAD ends the turn. Prints {"text",
"audio_bytes", "errors", "heard"}."""

import asyncio
import json
import sys
import wave

from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService


class Heard(FrameProcessor):
    """Before the service: catches the user's transcription, which it pushes upstream."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TranscriptionFrame):
            self.text = frame.text
        await self.push_frame(frame, direction)


class Sink(FrameProcessor):
    """After the service: the answer's text and audio. Spoken, the service first
    greets (its context holds only the instructions); the answer is the response
    that ends after the user's words were heard."""

    def __init__(self, heard: Heard | None) -> None:
        super().__init__()
        self.heard = heard
        self.done = asyncio.Event()
        self.out = {"text": "", "audio_bytes": 0, "errors": []}

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, LLMFullResponseStartFrame):
            self.out.update(text="", audio_bytes=0)
        elif isinstance(frame, TTSAudioRawFrame):
            self.out["audio_bytes"] += len(frame.audio)
        elif isinstance(frame, LLMTextFrame):
            self.out["text"] += frame.text
        elif isinstance(frame, ErrorFrame):
            self.out["errors"].append(str(frame.error))
            self.done.set()
        elif isinstance(frame, LLMFullResponseEndFrame):
            if self.heard is None or self.heard.text:
                self.done.set()
        await self.push_frame(frame, direction)


async def main(base_url: str, instructions: str, prompt: str, clip: str = "") -> None:
    url = base_url.replace("http://", "ws://") + "/realtime"
    settings = None
    if clip:  # the one setting changed: show the user's words, as Pipecat's docs do
        heard_too = events.AudioInput(transcription=events.InputAudioTranscription())
        properties = events.SessionProperties(audio=events.AudioConfiguration(input=heard_too))
        settings = OpenAIRealtimeLLMService.Settings(session_properties=properties)
    llm = OpenAIRealtimeLLMService(api_key="x", base_url=url, settings=settings)
    heard = Heard()
    sink = Sink(heard if clip else None)
    task = PipelineTask(Pipeline([heard, llm, sink]))
    runner = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    await asyncio.sleep(0.5)
    messages = [{"role": "system", "content": instructions}]
    if not clip:
        messages.append({"role": "user", "content": prompt})
    await task.queue_frame(LLMContextFrame(LLMContext(messages=messages)))
    if clip:
        with wave.open(clip) as w:
            rate, pcm = w.getframerate(), w.readframes(w.getnframes())
        piece = rate // 50 * 2  # 20 ms of PCM16
        for start in range(0, len(pcm) + rate * 2, piece):
            audio = pcm[start : start + piece] or bytes(piece)  # then silence
            await task.queue_frame(InputAudioRawFrame(audio, rate, 1))
            await asyncio.sleep(0.02)
    await asyncio.wait_for(sink.done.wait(), 240)
    await task.cancel()
    await runner
    print(json.dumps({**sink.out, "heard": heard.text}))


asyncio.run(main(*sys.argv[1:]))
