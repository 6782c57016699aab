"""The engine plug-in contract: what a stage asks of an engine, and what it gets back.

A stage runtime owns intake, segmenting and the wire; an engine checks one
request into a plan (``check``) and turns that plan into an async stream of
events (``generate``). Engines are plain Python and are tested without gRPC.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import torch
from pydantic import BaseModel

from services.engines.defaults import NONE, RequestDefaults
from services.mesh.finish import FinishReason, finish_reason

LoadFormat = Literal["auto", "dummy"]


@dataclass(frozen=True)
class EngineSettings:
    """Everything an engine needs from the stage file, validated once."""

    device: str = "cpu"
    dtype: str | None = None  # None: the engine's default for the device
    load_format: LoadFormat = "auto"
    max_prompt_tokens: int = 4096
    # The most requests one engine step may run together (the stage's runtime.max_batch_size).
    max_batch_size: int = 1
    cache_dir: Path = field(default_factory=lambda: Path("~/.cache/omni-mesh").expanduser())
    # The engine's settings model as the stage file validated it (engine_args.py), or a
    # plain mapping (an engine built directly, or a plug-in without a settings model).
    engine_args: Mapping[str, Any] | BaseModel = field(default_factory=dict)
    # The stage file's `defaults:`; an engine fills a request's unset parameters with
    # services.engines.defaults.resolve, which says what wins.
    defaults: RequestDefaults = NONE


@dataclass(frozen=True)
class SamplingParams:
    """A request's parameters; None means "the stage default"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    return_hidden_states: bool = False
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    preview_every: int | None = None
    return_png: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


MediaKind = Literal["image", "audio", "video"]


@dataclass(frozen=True)
class MediaPart:
    """An image, an audio clip or a video inside a chat message (stage.proto
    ``ContentPart``), as the stage received it: encoded bytes with their media
    type ("image/png", "image/jpeg", "audio/wav", "video/mp4", ...), or, for
    ``media_type == "audio/pcm"``, float32 mono samples at ``sample_rate``."""

    kind: MediaKind
    media_type: str
    data: bytes = b""
    pcm: torch.Tensor | None = None  # float32 [samples], audio/pcm only
    sample_rate: int = 0  # of ``pcm``


# One part of a chat message's content, in order: text, or media.
ContentPart = str | MediaPart


@dataclass(frozen=True)
class ChatTurn:
    """One chat message. ``content`` is its text (all its text parts joined, in
    order); ``parts`` is the whole content in order when the message has media,
    and empty for a text-only message (old clients, and most requests)."""

    role: str
    content: str
    parts: tuple[ContentPart, ...] = ()

    @property
    def media(self) -> tuple[MediaPart, ...]:
        return tuple(p for p in self.parts if isinstance(p, MediaPart))


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) of text-only chats
    # The whole chat with its content parts, set when any message carries media;
    # then ``messages`` holds the same chat's text. An engine whose ``accepts``
    # lacks a kind present here is refused by the stage before ``check``.
    turns: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] = ()
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    params: SamplingParams = SamplingParams()


@dataclass(frozen=True)
class EnginePlan:
    """One request as an engine's ``check`` found it, handed back to ``generate``:
    what ``check`` worked out (a tokenized prompt, resolved parameters, a job) is
    never worked out again. An engine that learns nothing more keeps just the
    request; the others subclass this with what they learned."""

    request: EngineRequest


PlanT = TypeVar("PlanT", bound=EnginePlan)


@dataclass(frozen=True)
class TokenOutput:
    """New tokens of an autoregressive request, in order."""

    token_ids: tuple[int, ...]
    text: str  # the text these tokens add (may be "" while a character is incomplete)
    hidden_states: torch.Tensor | None = None  # [len(token_ids), hidden] when asked for


@dataclass(frozen=True)
class Blob:
    name: str
    media_type: str
    data: bytes


@dataclass(frozen=True)
class AudioFormat:
    """How to play an "audio" output tensor (float32 PCM, [samples] or
    [samples, channels]): the Segment's audio_format on the wire."""

    sample_rate: int
    channels: int = 1


@dataclass(frozen=True)
class TensorOutput:
    """Whole outputs such as an image: tensors by name, and encoded blobs. An
    emitted tensor is handed over: the stage may send it later, or as the shared
    block it lives in, so the engine must not write to it again."""

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    blobs: tuple[Blob, ...] = ()
    audio_format: AudioFormat | None = None  # set when ``tensors`` holds "audio"


@dataclass(frozen=True)
class ProgressOutput:
    step: int
    total_steps: int
    preview: torch.Tensor | None = None  # uint8 [H, W, 3]


@dataclass(frozen=True)
class FinishOutput:
    """The last event of a request that ended well. ``reason`` is one of the mesh's
    (services/mesh/finish.py): anything else is refused here, where the engine says
    it, rather than reaching a client."""

    reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Time the request waited inside the engine for a place in a batch (its
    # admission), before its first step ran. A timing, not part of the outcome.
    queue_ms: float = field(default=0.0, compare=False)

    def __post_init__(self) -> None:
        finish_reason(self.reason)


EngineEvent = TokenOutput | TensorOutput | ProgressOutput | FinishOutput


@dataclass(frozen=True)
class KvGeometry:
    """What one KV page costs: the inputs of the formula in docs/design.md, 'Memory planning'."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    tensor_parallel: int = 1


@dataclass(frozen=True)
class ModelInfo:
    """What ``load`` reports: the bytes the weights take and the KV layout."""

    model_bytes: int
    kv: KvGeometry | None = None  # None for engines without a KV cache
    description: str = ""
    # How the engine computes (its runner, how its weights are held, the CPU kernels
    # or vLLM's kernel variant): logged at start and reported by Describe.
    compute: str = ""


class Engine(Protocol[PlanT]):
    """An engine plug-in, over the plan type its ``check`` returns. ``load`` and
    ``warmup`` block (a stage calls them in a thread). ``check`` turns a request
    into a plan; ``generate`` runs that plan, an async generator that stops at
    the next step boundary when its consumer stops iterating: closing it
    (``aclose``, or the consuming task cancelled) is the one way a request is
    cancelled or aborted.

    Errors: an ``OmniError`` from ``generate`` ends that request with its
    status; ``services.mesh.errors.EngineDead`` says the engine itself is gone,
    and the stage then fails and exits to be restarted.

    Settings: an engine may name its ``engine_args`` model as the class attribute
    ``settings_model`` (an ``engine_args.EngineArgs``); the stage then validates
    them when it loads the stage file. Parameters a request leaves unset arrive
    unset: ``defaults.resolve`` fills them in."""

    name: ClassVar[str]
    # GenerationParams fields (and `extra` keys as "extra.KEY") this engine honours;
    # anything else set on a request is refused by name.
    supported_params: ClassVar[frozenset[str]]
    # Names of the tensors this engine can emit.
    output_tensors: ClassVar[tuple[str, ...]]
    # Optional ``accepts``: the content kinds ("text", "image", "audio", "video") a
    # message may carry in; others are refused by name. Default text only (accepted_kinds).

    def __init__(self, settings: EngineSettings) -> None: ...

    def load(self, model_path: Path | None) -> ModelInfo:
        """Load from a fetched file or folder; None only with load_format dummy
        for an engine that can build its model from engine_args alone."""
        ...

    def warmup(self) -> None: ...

    def check(self, request: EngineRequest) -> PlanT:
        """Validation at intake, once per request or input window (a stage calls it in
        a thread: it may tokenize); raise ``InvalidArgument`` naming the field. The
        plan it returns is what ``generate`` gets. It only checks: an engine that
        must hear of an arrival, or use a window before its ``generate``, says so
        with a capability (capabilities.py: ``HearsArrivals``, ``TakesWindowsEarly``)."""
        ...

    def generate(self, plan: PlanT) -> AsyncGenerator[EngineEvent, None]: ...

    def close(self) -> None: ...


class OutputBlocks(Protocol):
    """Where an engine may put an output it is about to compute."""

    def allocate(self, owner: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A writable CPU tensor for request ``owner``'s output: written in place
        and emitted as is, it reaches a same-node consumer with no copy."""
        ...


class HeapBlocks:
    """``OutputBlocks`` of plain memory: what an engine uses until a stage gives it
    shared blocks (and in tests without a stage)."""

    def allocate(self, owner: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)
