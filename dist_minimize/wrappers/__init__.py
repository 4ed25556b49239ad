"""Wrappers: compressed aggregation, loss scaling, gradient accumulation, moving average, SWA, Lookahead, decoupled weight decay,
differential privacy, SAM."""

from dist_minimize.wrappers.accumulation import GradientAccumulation
from dist_minimize.wrappers.compression import CompressedAggregation
from dist_minimize.wrappers.lookahead import Lookahead
from dist_minimize.wrappers.loss_scale import LossScaleOptimizer
from dist_minimize.wrappers.moving_average import MovingAverage
from dist_minimize.wrappers.dp_sgd import DifferentialPrivacy
from dist_minimize.wrappers.sam import SAM
from dist_minimize.wrappers.swa import SWA, update_batch_norm
from dist_minimize.wrappers.weight_decay import DecoupledWeightDecay

__all__ = ["CompressedAggregation", "DecoupledWeightDecay", "DifferentialPrivacy", "GradientAccumulation", "Lookahead",
           "LossScaleOptimizer", "MovingAverage", "SAM", "SWA", "update_batch_norm"]
