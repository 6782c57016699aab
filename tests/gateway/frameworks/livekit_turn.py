"""One text turn through LiveKit Agents' openai.realtime.RealtimeModel at its
defaults, without a room (AgentSession.run): BASE_URL INSTRUCTIONS PROMPT.
Prints {"text", "errors"}."""

import asyncio
import json
import sys

from livekit.agents import Agent, AgentSession
from livekit.plugins import openai


async def main(base_url: str, instructions: str, prompt: str) -> None:
    out = {"text": "", "errors": []}
    model = openai.realtime.RealtimeModel(base_url=base_url, api_key="x")
    async with AgentSession(llm=model) as session:
        session.on("error", lambda event: out["errors"].append(str(event.error)))
        await session.start(Agent(instructions=instructions))
        result = await session.run(user_input=prompt)
        for event in result.events:
            item = getattr(event, "item", None)
            if item is not None and getattr(item, "role", "") == "assistant":
                out["text"] = "".join(c for c in item.content if isinstance(c, str))
    print(json.dumps(out))


asyncio.run(asyncio.wait_for(main(*sys.argv[1:4]), 240))
