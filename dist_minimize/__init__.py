"""dist_minimize: RFC 234's customizable `Optimizer.minimize` for Keras 3, correct under
data-parallel distribution (tf.distribute, Horovod).

Public API:
  Optimizer, OptimizerWrapper, StagedOptimizer: the staged optimizers.
  clip_by_global_norm, clip_by_norm, clip_by_value, global_norm: gradient transforms.
  GradientTransform: base class for transforms with state or configuration.
  aggregation: the backends (`Aggregator`, `StrategyAggregator`, `HorovodAggregator`).
  callbacks: Keras callbacks (`GradientStatsLogger`).
  horovod_keras: Keras 3 + Horovod (broadcast, metric averaging, rank-0 output, sharding).
  cluster: rank/size discovery (horovodrun, mpirun, srun, TF_CONFIG), Horovod from mpi4py.
  launcher: horovodrun / mpirun / multi-worker / mirrored launches.
  privacy: DP-SGD accounting (`epsilon`, from dp-accounting's RDP accountant).
"""

from dist_minimize import aggregation, callbacks, cluster, distribute, horovod_keras, launcher, privacy
from dist_minimize._compat import MissingDependencyError
from dist_minimize.fit import integrate
from dist_minimize._finite import all_finite
from dist_minimize.optimizer import Optimizer
from dist_minimize.staged import StagedOptimizer
from dist_minimize.transforms import (
    ClipByGlobalNorm,
    ClipByNorm,
    ClipByValue,
    GradientTransform,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
)
from dist_minimize.transforms.consistency import ConsistencyCheck, check_consistency
from dist_minimize.transforms.nonfinite import LimitNonFiniteSteps, limit_nonfinite_steps
from dist_minimize.wrapper import OptimizerWrapper, swap_values
from dist_minimize.wrappers import (
    SWA,
    DecoupledWeightDecay,
    DifferentialPrivacy,
    GradientAccumulation,
    Lookahead,
    LossScaleOptimizer,
    MovingAverage,
    update_batch_norm,
)

__version__ = "0.1.0"

__all__ = [
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "ConsistencyCheck",
    "DecoupledWeightDecay",
    "DifferentialPrivacy",
    "GradientAccumulation",
    "Lookahead",
    "MovingAverage",
    "SWA",
    "update_batch_norm",
    "GradientTransform",
    "LimitNonFiniteSteps",
    "LossScaleOptimizer",
    "MissingDependencyError",
    "Optimizer",
    "OptimizerWrapper",
    "StagedOptimizer",
    "aggregation",
    "all_finite",
    "callbacks",
    "check_consistency",
    "cluster",
    "distribute",
    "horovod_keras",
    "integrate",
    "launcher",
    "privacy",
    "limit_nonfinite_steps",
    "swap_values",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
]
