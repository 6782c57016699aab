"""The Qwen3-Omni processor without its video half.

transformers' ``Qwen3OmniMoeProcessor`` insists on a video processor, whose
classes need torchvision; the PyPI torchvision is a CUDA build that breaks
``import transformers`` beside CPU torch. The thinker takes text, images and
audio, so its processor is put together here from the tokenizer, the image
processor and the audio feature extractor a checkpoint folder holds (the real
Qwen3-Omni folder and the tiny one alike), and the video slot stays empty.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_FILE = "chat_template.jinja"
PREPROCESSOR_FILE = "preprocessor_config.json"


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _processor_class() -> type:
    from transformers import Qwen3OmniMoeProcessor

    class NoVideoProcessor(Qwen3OmniMoeProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return NoVideoProcessor


def make(tokenizer: Any, image_processor: Any, feature_extractor: Any, chat_template: str) -> Any:
    return _processor_class()(
        image_processor=image_processor,
        video_processor=None,
        feature_extractor=feature_extractor,
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def save(processor: Any, folder: Path) -> None:
    """The parts as a Qwen3-Omni folder holds them: the image processor's and the
    feature extractor's settings merged into one preprocessor_config.json."""
    processor.tokenizer.save_pretrained(folder)
    merged = {**processor.image_processor.to_dict(), **processor.feature_extractor.to_dict()}
    merged.pop("processor_class", None)
    (folder / PREPROCESSOR_FILE).write_text(json.dumps(merged, indent=1, default=_plain))
    (folder / CHAT_TEMPLATE_FILE).write_text(processor.chat_template)


def load(folder: Path) -> Any:
    """The processor of checkpoint ``folder`` (nothing fetched: a local folder only)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    image = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    audio = WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
    template_file = folder / CHAT_TEMPLATE_FILE
    template = template_file.read_text() if template_file.is_file() else tokenizer.chat_template
    return make(tokenizer, image, audio, template)
