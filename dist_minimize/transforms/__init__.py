"""Gradient transforms: global-norm clipping, per-tensor clipping, value clipping."""

from dist_minimize.transforms.base import GradientTransform
from dist_minimize.transforms.clipping import (
    ClipByGlobalNorm,
    ClipByNorm,
    ClipByValue,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
)

__all__ = [
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "GradientTransform",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
]
