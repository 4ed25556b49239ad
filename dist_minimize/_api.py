"""The package's API that needs TensorFlow and Keras: what `dist_minimize/__init__.py`
imported eagerly up to 0.1.0. `__init__` imports this module when the API is first
needed (see its docstring) and copies these names into the package; importing it
registers every serializable class with Keras.
"""

from dist_minimize import (  # noqa: F401
    aggregation, callbacks, checkpoint, cluster, distribute, horovod_keras, launcher, privacy)
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
from dist_minimize.wrapper import OptimizerWrapper, swap_values  # noqa: F401
from dist_minimize.wrappers import (  # noqa: F401
    SWA,
    DecoupledWeightDecay,
    DifferentialPrivacy,
    GradientAccumulation,
    Lookahead,
    LossScaleOptimizer,
    SAM,
    MovingAverage,
    update_batch_norm,
)
