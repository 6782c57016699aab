"""One turn through the OpenAI Agents SDK's RealtimeAgent/RealtimeRunner at its
defaults: BASE_URL INSTRUCTIONS PROMPT [WAV]. Prints {"text", "audio_bytes", "errors"}."""

import asyncio
import json
import sys
import wave

from agents.realtime import RealtimeAgent, RealtimeRunner


async def main(base_url: str, instructions: str, prompt: str, clip: str | None) -> None:
    agent = RealtimeAgent(name="agent", instructions=instructions)
    url = base_url.replace("http://", "ws://") + "/realtime"
    session = await RealtimeRunner(agent).run(model_config={"url": url, "api_key": "x"})
    out = {"text": "", "audio_bytes": 0, "errors": [], "heard": ""}
    async with session:
        if clip:
            with wave.open(clip) as w:
                await session.send_audio(w.readframes(w.getnframes()) + bytes(48000 * 2))
        else:
            await session.send_message(prompt)
        async for event in session:
            if event.type == "audio":
                out["audio_bytes"] += len(event.audio.data)
            elif event.type == "error":
                out["errors"].append(str(event.error))
            elif event.type == "raw_model_event" and event.data.type == "error":
                out["errors"].append(str(event.data))
            elif event.type == "history_updated":
                for item in event.history:
                    for part in getattr(item, "content", []):
                        said = getattr(part, "transcript", None) or getattr(part, "text", None)
                        if item.role == "assistant" and said:
                            out["text"] = said
                        elif item.role == "user" and said:
                            out["heard"] = said
            elif event.type == "agent_end":
                break
    print(json.dumps(out))


args = sys.argv[1:]
asyncio.run(
    asyncio.wait_for(main(args[0], args[1], args[2], args[3] if len(args) > 3 else None), 240)
)
