"""pytest plugin: run Keras 3's own optimizer tests with every Keras optimizer class
replaced by `dist_minimize.Optimizer.from_keras(<that optimizer>)` (the `Optimizer`, in the
wrappers its `use_ema`, `gradient_accumulation_steps` or `loss_scale_factor` call for).

Used by tests/unit/test_keras_own_suite.py on the test files installed with Keras
(`keras/src/optimizers/*_test.py`); nothing of them is copied here. Load it with
`-p dm_keras_substitute` (this folder on `sys.path`).

What is substituted, in the test modules only (Keras itself and dist_minimize keep the
real classes):
* each optimizer class (`Adam`, `SGD`, ... ; also reached as `optimizers.Adam` through
  `from keras.src import optimizers`): calling it returns
  `dist_minimize.Optimizer.from_keras(<the Keras class>(*args, **kwargs))`; `isinstance(x, Adam)`
  is true for a dist_minimize stack around a Keras Adam; `Adam.from_config(config)`
  builds the same stack;
* `optimizers.get(...)`: Keras's result, wrapped the same way;
* `optimizers.LossScaleOptimizer(inner, initial_scale, dynamic_growth_steps)`:
  `dist_minimize.LossScaleOptimizer(inner, initial_scale=..., growth_interval=...)`
  (dist_minimize refuses Keras's own, which decides skips from one replica's gradients).
Classes are replaced while the test modules are imported (so that module-level tables
of classes, such as optimizer_sparse_test's TEST_CASES, hold the substitutes), then
Keras's modules get their real classes back and each test module's reference to the
`keras.src.optimizers` package is pointed at a substituting proxy.

`--dm-outcomes=PATH` writes `{nodeid: "passed" | "failed" | "skipped"}` as JSON.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import keras
import pytest

import dist_minimize as dm
from dist_minimize.staged import StagedOptimizer

_PACKAGE = importlib.import_module("keras.src.optimizers")
_KERAS_BASE = keras.optimizers.Optimizer
_KERAS_LSO = keras.optimizers.LossScaleOptimizer
_NOT_SUBSTITUTED = {"Optimizer", "MultiOptimizer"}  # the base class; a router of optimizers


def _is_keras_optimizer_class(obj) -> bool:
    return (isinstance(obj, type) and not isinstance(obj, Substitute) and issubclass(obj, _KERAS_BASE)
            and obj.__name__ not in _NOT_SUBSTITUTED and obj.__module__.startswith("keras."))


def _core(obj):
    return obj.stack()[-1] if isinstance(obj, StagedOptimizer) else None


class Substitute(type):
    """Metaclass of the stand-ins: an instance of it is a stand-in for one Keras class."""

    def __call__(cls, *args, **kwargs):
        return cls.make(*args, **kwargs)

    def __instancecheck__(cls, obj):
        core = _core(obj)
        if cls.keras_class is _KERAS_LSO:
            return isinstance(obj, dm.LossScaleOptimizer)
        return core is not None and isinstance(getattr(core, "inner_optimizer", None), cls.keras_class)

    def __getattr__(cls, name):
        return getattr(cls.keras_class, name)

    def __repr__(cls):
        return f"<dist_minimize stand-in for {cls.keras_class.__module__}.{cls.keras_class.__name__}>"


def _make_optimizer(cls, *args, **kwargs):
    return dm.Optimizer.from_keras(cls.keras_class(*args, **kwargs))


def _from_config(cls, config, custom_objects=None):
    if "optimizer" in config:  # a dist_minimize config
        return dm.Optimizer.from_config(config, custom_objects=custom_objects)
    return dm.Optimizer.from_keras(cls.keras_class.from_config(dict(config), custom_objects=custom_objects))


def _make_loss_scale(cls, inner_optimizer, initial_scale=2.0 ** 15, dynamic_growth_steps=2000, name=None, **kwargs):
    if not isinstance(inner_optimizer, StagedOptimizer):
        inner_optimizer = dm.Optimizer.from_keras(inner_optimizer)
    return dm.LossScaleOptimizer(inner_optimizer, initial_scale=initial_scale, growth_interval=dynamic_growth_steps,
                                 name=name, **kwargs)


def substitute_for(keras_class):
    make = _make_loss_scale if keras_class is _KERAS_LSO else _make_optimizer
    return Substitute(keras_class.__name__, (), {
        "keras_class": keras_class, "make": classmethod(make), "from_config": classmethod(_from_config)})


class _Proxy(types.ModuleType):
    """`keras.src.optimizers` with the stand-ins and a wrapping `get`."""

    def __init__(self, substitutes):
        super().__init__(_PACKAGE.__name__, _PACKAGE.__doc__)
        self.__dict__.update(substitutes)
        self.get = _get

    def __getattr__(self, name):
        return getattr(_PACKAGE, name)


def _get(identifier):
    obj = _PACKAGE.get(identifier)
    if isinstance(obj, _KERAS_BASE) and not isinstance(obj, (StagedOptimizer, _KERAS_LSO)):
        return dm.Optimizer.from_keras(obj)
    return obj


class _Plugin:
    def __init__(self, outcomes_path):
        self.outcomes_path = outcomes_path
        self.outcomes = {}
        self.substitutes = {}
        self.patched = []  # (module, name, original)
        for module_name, module in list(sys.modules.items()):
            if module_name != _PACKAGE.__name__ and not module_name.startswith(_PACKAGE.__name__ + "."):
                continue
            if module is None or module_name.endswith("_test"):
                continue
            for name, obj in list(vars(module).items()):
                if _is_keras_optimizer_class(obj):
                    stand_in = self.substitutes.setdefault(obj, substitute_for(obj))
                    self.patched.append((module, name, obj))
                    setattr(module, name, stand_in)
        self.proxy = _Proxy({k.__name__: v for k, v in self.substitutes.items()})

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        for module, name, original in self.patched:
            setattr(module, name, original)
        for module in {item.module for item in session.items if getattr(item, "module", None) is not None}:
            for name, obj in list(vars(module).items()):
                if obj is _PACKAGE:
                    setattr(module, name, self.proxy)
                elif _is_keras_optimizer_class(obj) and obj.__module__ != module.__name__:
                    setattr(module, name, self.substitutes.setdefault(obj, substitute_for(obj)))

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            previous = self.outcomes.get(report.nodeid)
            if previous != "failed":
                self.outcomes[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session):
        if self.outcomes_path:
            with open(self.outcomes_path, "w") as f:
                json.dump(self.outcomes, f, indent=1, sort_keys=True)


def pytest_addoption(parser):
    parser.addoption("--dm-outcomes", default=None, help="write each test's outcome to this JSON file")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's marker (TensorFlow is trainable)")
    config.pluginmanager.register(_Plugin(config.getoption("--dm-outcomes")), "dm_keras_substitute_impl")
