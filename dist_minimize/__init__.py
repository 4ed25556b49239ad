"""dist_minimize: RFC 234's customizable `Optimizer.minimize` for Keras 3, correct under
data-parallel distribution (tf.distribute, Horovod).

Public API:
  Optimizer, OptimizerWrapper, StagedOptimizer: the staged optimizers.
  step_context, StepContext: what the parts of one step tell each other.
  clip_by_global_norm, clip_by_norm, clip_by_value, global_norm: gradient transforms.
  GradientTransform: base class for transforms with state or configuration.
  aggregation: the backends (`Aggregator`, `StrategyAggregator`, `HorovodAggregator`).
  callbacks: Keras callbacks (`GradientStatsLogger`).
  Checkpointer (module checkpoint): exact resume after a lost or preempted worker.
  horovod_keras: Keras 3 + Horovod (broadcast, metric averaging, rank-0 output, sharding).
  cluster: rank/size discovery (horovodrun, mpirun, srun, TF_CONFIG), Horovod from mpi4py,
    a MultiWorkerMirroredStrategy joined in bounded time.
  elastic: a fixed global batch of fixed micro-batches on any number of workers.
  launcher: horovodrun / mpirun / multi-worker / mirrored launches.
  privacy: DP-SGD accounting (`epsilon`, from dp-accounting's RDP accountant).

Importing the package imports TensorFlow and Keras and registers every serializable
class with Keras (`keras.saving.load_model` finds them by name, "dist_minimize>Lookahead",
in its registry only), and changes nothing else: no TensorFlow, Keras or Horovod
attribute and no import machinery (tests/unit/test_isolation.py, test_import.py).
"""

from dist_minimize import (  # noqa: F401
    aggregation, callbacks, checkpoint, cluster, distribute, elastic, horovod_keras, launcher, privacy)
from dist_minimize._compat import MissingDependencyError  # noqa: F401
from dist_minimize.checkpoint import Checkpointer  # noqa: F401
from dist_minimize.sharding.sharded_state import state_bytes as optimizer_state_bytes  # noqa: F401
from dist_minimize.step.zones import ContractError  # noqa: F401
from dist_minimize.fit import integrate  # noqa: F401
from dist_minimize.step.finite import all_finite  # noqa: F401
from dist_minimize.step.context import StepContext, step_context  # noqa: F401
from dist_minimize.optimizer import Optimizer  # noqa: F401
from dist_minimize.staged import StagedOptimizer  # noqa: F401
from dist_minimize.transforms import (  # noqa: F401
    ClipByGlobalNorm,
    ClipByNorm,
    ClipByValue,
    GradientTransform,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
)
from dist_minimize.transforms.consistency import ConsistencyCheck, check_consistency  # noqa: F401
from dist_minimize.transforms.nonfinite import LimitNonFiniteSteps, limit_nonfinite_steps  # noqa: F401
from dist_minimize.wrappers.base import OptimizerWrapper, swap_values  # noqa: F401
from dist_minimize.wrappers import (  # noqa: F401
    SWA,
    CompressedAggregation,
    DecoupledWeightDecay,
    DifferentialPrivacy,
    GradientAccumulation,
    Lookahead,
    LossScaleOptimizer,
    SAM,
    MovingAverage,
    update_batch_norm,
)

__version__ = "0.1.0"

__all__ = [
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
    "CompressedAggregation",
    "ConsistencyCheck",
    "ContractError",
    "DecoupledWeightDecay",
    "DifferentialPrivacy",
    "GradientAccumulation",
    "Lookahead",
    "MovingAverage",
    "SAM",
    "SWA",
    "update_batch_norm",
    "GradientTransform",
    "LimitNonFiniteSteps",
    "LossScaleOptimizer",
    "MissingDependencyError",
    "Optimizer",
    "OptimizerWrapper",
    "StagedOptimizer",
    "StepContext",
    "aggregation",
    "all_finite",
    "callbacks",
    "check_consistency",
    "checkpoint",
    "Checkpointer",
    "optimizer_state_bytes",
    "cluster",
    "elastic",
    "distribute",
    "horovod_keras",
    "integrate",
    "launcher",
    "privacy",
    "limit_nonfinite_steps",
    "step_context",
    "swap_values",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
]
