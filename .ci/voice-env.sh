#!/usr/bin/env bash
# Creates (or brings up to date) .venv-voice: the voice-agent frameworks' own
# realtime clients (OpenAI Agents SDK, Pipecat, LiveKit Agents), for
# tests/gateway/realtime/test_frameworks.py, which runs each framework's turn
# (tests/gateway/frameworks/*.py) with this venv's Python against a gateway the
# main venv starts. A venv of their own: their pins are not the mesh's (LiveKit
# needs protobuf < 7; the mesh runs 7), and the mesh never imports them.
# Idempotent: a second run from the same inputs does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=.venv-voice
# One at a time: .ci/run starts this in the background while the main venv installs
# and the tests run; the test command's own call waits here, then only re-checks.
mkdir -p "$venv"
exec 9>"$venv/.building"
flock 9
# Built already from these very inputs (by the background run, say): nothing to do.
stamp=$(cat "$0" | sha256sum | cut -c1-16)
if [ "$(cat "$venv/.built" 2>/dev/null)" = "$stamp" ]; then
    echo "$venv: up to date"
    exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q 'openai-agents>=0.24,<0.25' 'pipecat-ai[openai]>=1.14,<2' \
    'livekit-agents>=1.8.9,<1.9' 'livekit-plugins-openai>=1.8.9,<1.9'
"$venv/bin/python" -c '
from agents.realtime import RealtimeRunner
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from livekit.plugins import openai
'
echo "$stamp" >"$venv/.built"
