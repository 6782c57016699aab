"""One turn through LiveKit Agents' openai.realtime.RealtimeModel at its
defaults, without a room: BASE_URL INSTRUCTIONS PROMPT [WAV]. Typed, the turn is
AgentSession.run(user_input=PROMPT). With a WAV (24 kHz mono PCM16) the question
is spoken: the session's audio input is the clip in 20 ms frames at the pace of
speech, then silence, and the server's VAD ends the turn. Prints {"text",
"errors", "heard"}."""

import asyncio
import json
import sys
import wave

from livekit import rtc
from livekit.agents import Agent, AgentSession
from livekit.agents.voice.io import AudioInput
from livekit.plugins import openai

FRAME_S = 0.02


class Clip(AudioInput):
    """The clip as a microphone would give it, then silence until the turn is over."""

    def __init__(self, path: str) -> None:
        super().__init__(label="clip")
        with wave.open(path) as w:
            self.rate, self.pcm = w.getframerate(), w.readframes(w.getnframes())
        self.at = 0
        self.samples = int(self.rate * FRAME_S)

    async def __anext__(self) -> rtc.AudioFrame:
        await asyncio.sleep(FRAME_S)
        piece = self.pcm[self.at : self.at + 2 * self.samples].ljust(2 * self.samples, b"\0")
        self.at += 2 * self.samples
        return rtc.AudioFrame(piece, self.rate, 1, self.samples)


async def main(base_url: str, instructions: str, prompt: str, clip: str = "") -> None:
    out = {"text": "", "errors": [], "heard": ""}
    answered = asyncio.Event()
    model = openai.realtime.RealtimeModel(base_url=base_url, api_key="x")
    async with AgentSession(llm=model) as session:
        session.on("error", lambda event: out["errors"].append(str(event.error)))

        def heard(event) -> None:
            if event.is_final:
                out["heard"] = event.transcript

        def added(event) -> None:
            item = event.item
            if getattr(item, "role", "") == "assistant" and (out["heard"] or not clip):
                out["text"] = "".join(c for c in item.content if isinstance(c, str))
                answered.set()

        session.on("user_input_transcribed", heard)
        session.on("conversation_item_added", added)
        if clip:
            session.input.audio = Clip(clip)
            await session.start(Agent(instructions=instructions))
            await asyncio.wait_for(answered.wait(), 200)
        else:
            await session.start(Agent(instructions=instructions))
            result = await session.run(user_input=prompt)
            for event in result.events:
                item = getattr(event, "item", None)
                if item is not None and getattr(item, "role", "") == "assistant":
                    out["text"] = "".join(c for c in item.content if isinstance(c, str))
    print(json.dumps(out))


asyncio.run(asyncio.wait_for(main(*sys.argv[1:]), 240))
