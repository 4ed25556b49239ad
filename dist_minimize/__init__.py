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
  cluster: rank/size discovery (horovodrun, mpirun, srun, TF_CONFIG), Horovod from mpi4py.
  launcher: horovodrun / mpirun / multi-worker / mirrored launches.
  privacy: DP-SGD accounting (`epsilon`, from dp-accounting's RDP accountant).

Importing the package does not import TensorFlow or Keras, so that the launcher
(`import dist_minimize.launcher`, `launch/launch.py`) starts at once: Python runs this
file before any submodule, and it cannot tell (short of inspecting its importer's
frames) that only the launcher is wanted. The rest of the API is imported from
`_api.py`, all of it at once, at the first of:

* the first use of one of its names: `dm.Optimizer`, `from dist_minimize import
  Optimizer`, `dm.wrappers`, `dir(dm)`;
* `import dist_minimize` itself, when Keras or TensorFlow is already imported;
* the end of the first import of Keras or TensorFlow after it (a `sys.meta_path` hook,
  removed once it has run).

The last two exist for Keras's loading: a `.keras` file names its classes
("dist_minimize>Lookahead"), and Keras finds them only in its registry of
`register_keras_serializable` classes; it imports no module of a package other than its
own (keras/src/saving/serialization_lib.py, `_retrieve_class_or_fn`). Registering them
when Keras arrives, before any Keras call can read a file, keeps `import dist_minimize`
followed by `keras.saving.load_model(...)` working as when this file imported everything.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and mkdocstrings read; at run time, `_load_api`
    from dist_minimize._api import *  # noqa: F403

__version__ = "0.1.0"

__all__ = [
    "ClipByGlobalNorm",
    "ClipByNorm",
    "ClipByValue",
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


_LIGHT = ("launcher", "launch")  # the submodules that need no TensorFlow
_TRIGGERS = ("keras", "tensorflow")


def _load_api() -> None:
    """Imports `_api.py` (TensorFlow, Keras, and the classes' registration with Keras) and
    puts its names in this package's namespace."""
    _HOOK.remove()
    api = importlib.import_module(f"{__name__}._api")
    globals().update((k, v) for k, v in vars(api).items() if not k.startswith("__"))


def __getattr__(name: str):
    if name in _LIGHT:
        return importlib.import_module(f"{__name__}.{name}")
    if not name.startswith("__"):
        _load_api()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    _load_api()
    return sorted(globals())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `_load_api` once the outermost import of Keras or TensorFlow has executed (each
    imports the other: the API loads when both are complete). An error of the load that
    is an ImportError (TensorFlow missing under another Keras backend) is left for the
    first use of the API to raise again, rather than failing the user's `import keras`."""

    def __init__(self):
        self.depth = 0
        self.finding = False

    def find_spec(self, name, path=None, target=None):
        if name not in _TRIGGERS or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(name)  # the other finders' spec
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self)
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def ran(self) -> None:
        if self.depth == 0 and self in sys.meta_path:
            try:
                _load_api()
            except ImportError:
                pass


class _Loader(importlib.abc.Loader):
    """The original loader, with `_AfterImport.ran` called after the module executes."""

    def __init__(self, loader, hook: _AfterImport):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # as if imported without the hook
        self.hook.depth += 1
        try:
            self.loader.exec_module(module)
        finally:
            self.hook.depth -= 1
        self.hook.ran()


_HOOK = _AfterImport()
if any(name in sys.modules for name in _TRIGGERS):
    _load_api()
else:
    sys.meta_path.insert(0, _HOOK)
