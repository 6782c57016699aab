"""The ``video`` engine: a windowed video upscaler split over two devices, its
windows pipelined (pipeline.py) on in-order device queues (devices.py); and
``video_frames``, a test-pattern frame source to feed it (source.py)."""

from services.engines.video.config import ModelShape, VideoArgs
from services.engines.video.engine import VideoEngine
from services.engines.video.source import FrameSourceEngine

__all__ = ["FrameSourceEngine", "ModelShape", "VideoArgs", "VideoEngine"]
