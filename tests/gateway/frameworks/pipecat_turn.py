"""One text turn through Pipecat's OpenAIRealtimeLLMService at its defaults:
BASE_URL INSTRUCTIONS PROMPT. Prints {"text", "audio_bytes", "errors"}."""

import asyncio
import json
import sys

from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    LLMContextFrame,
    LLMFullResponseEndFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.runner import PipelineRunner
from pipecat.pipeline.task import PipelineTask
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService


class Sink(FrameProcessor):
    def __init__(self) -> None:
        super().__init__()
        self.done = asyncio.Event()
        self.out = {"text": "", "audio_bytes": 0, "errors": []}

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.out["audio_bytes"] += len(frame.audio)
        elif isinstance(frame, LLMTextFrame):
            self.out["text"] += frame.text
        elif isinstance(frame, ErrorFrame):
            self.out["errors"].append(str(frame.error))
            self.done.set()
        elif isinstance(frame, LLMFullResponseEndFrame):
            self.done.set()
        await self.push_frame(frame, direction)


async def main(base_url: str, instructions: str, prompt: str) -> None:
    url = base_url.replace("http://", "ws://") + "/realtime"
    llm = OpenAIRealtimeLLMService(api_key="x", base_url=url)
    sink = Sink()
    task = PipelineTask(Pipeline([llm, sink]))
    runner = asyncio.create_task(PipelineRunner(handle_sigint=False).run(task))
    await asyncio.sleep(0.5)
    context = LLMContext(
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": prompt}]
    )
    await task.queue_frame(LLMContextFrame(context))
    await asyncio.wait_for(sink.done.wait(), 240)
    await task.cancel()
    await runner
    print(json.dumps(sink.out))


asyncio.run(main(*sys.argv[1:4]))
