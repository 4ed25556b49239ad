"""Wrappers: loss scaling, gradient accumulation."""

from dist_minimize.wrappers.accumulation import GradientAccumulation
from dist_minimize.wrappers.loss_scale import LossScaleOptimizer

__all__ = ["GradientAccumulation", "LossScaleOptimizer"]
