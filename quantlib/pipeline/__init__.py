"""The main job in one call: a Hugging Face model directory quantized, evaluated, exported, reloaded by the
export's consumer and checked (``quantlib quantize`` / :func:`oneshot`)."""

from .options import OneshotOptions, PipelineError
from .run import oneshot

__all__ = ["OneshotOptions", "PipelineError", "oneshot"]
