"""The speaker's tokenizer (services/engines/speech/tokens.py): read out of the
GGUF once into the cache and then loaded with ``tokenizers``, it decodes every
token and every answer exactly as transformers' own reading of the GGUF does;
a stage's first start on a cache says so as its PREPARE step, later ones and
one whose cache holds the thinker's conversion of the file skip it."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from services.engines.gguf_cache import converted_target
from services.engines.speech import tokens
from services.engines.transformers.loading import converted_folder
from services.mesh.pb.omni.v1 import stage_pb2
from tests.engines.speech.conftest import speaker_config
from tests.stage.startup.test_startup_events import start_and_follow

TEXTS = [
    "Hello! How are you today?",
    "Café, naïve, 東京, emoji 🙂 and   spaces\ttabs\nnewlines.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
]


def test_it_decodes_as_transformers_reads_the_gguf(tmp_path: Path, smollm2_gguf: Path) -> None:
    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    fast = tokens.decoder(smollm2_gguf, tmp_path)

    def expected(ids: list[int]) -> str:
        text: str = reference.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text

    every = range(len(reference))  # one by one: byte pieces, special tokens and all
    assert [fast.decode([i]) for i in every] == [expected([i]) for i in every]
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        assert fast.decode(ids) == expected(ids), text
        # as a speaker gets them: a prefix at a time, split inside characters too
        assert [fast.decode(ids[:n]) for n in range(len(ids))] == [
            expected(ids[:n]) for n in range(len(ids))
        ]


def phases(events: list[stage_pb2.InitEvent]) -> list[str]:
    return [stage_pb2.InitPhase.Name(e.phase) for e in events]


async def test_a_speaker_reads_the_gguf_for_its_tokenizer_once(
    tmp_path: Path, smollm2_gguf: Path
) -> None:
    config = speaker_config(str(tmp_path / "cache"))
    first = await start_and_follow(config)
    names = phases(first)
    assert names.index("DOWNLOAD_DONE") < names.index("PREPARE") < names.index("LOAD_START")
    prepare = first[names.index("PREPARE")]
    assert prepare.message == f"reading the tokenizer out of {smollm2_gguf.name} (once per file)"
    again = phases(await start_and_follow(config))
    assert "PREPARE" not in again and "READY" in again


async def test_a_speaker_beside_a_thinker_uses_its_conversion(
    omni_cache_dir: Path, smollm2_gguf: Path
) -> None:
    converted_folder(smollm2_gguf, omni_cache_dir)  # as the thinker's stage does
    assert tokens.pending(smollm2_gguf, omni_cache_dir) is None
    found = phases(await start_and_follow(speaker_config(str(omni_cache_dir))))
    assert "PREPARE" not in found and "READY" in found
    assert (converted_target(smollm2_gguf, omni_cache_dir)[1] / "tokenizer.json").is_file()
