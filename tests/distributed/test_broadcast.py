"""The broadcast from a root rank (`dm.horovod_keras.broadcast_model_and_optimizer`,
`BroadcastVariablesCallback`) matches variables by their place in the model and the
optimizer stack, never by name: on Horovod's resume pattern (rank 0 loads a saved model,
whose variables Keras names `dense/kernel`; the others build a fresh one,
`sequential/dense/kernel`) every rank ends with rank 0's weights and EVERY optimizer
variable (momentum included), and stays equal (0.0) through later steps. Ranks that
built another model or stack are refused on every rank, in bounded time; sharded state
broadcasts what every rank holds, and is refused where the ranks' shares are at
different steps. Jobs (tests/workers/broadcast_worker.py): horovodrun -np 2 (Gloo) and
mpirun -np 2."""

import json
import os

import keras
import numpy as np
import pytest

import jobs
import proc
from dist_minimize import launcher
from jobs import run_param

import dist_minimize as dm

pytestmark = pytest.mark.distributed

WORKER = "tests/workers/broadcast_worker.py"
RUNS = [run_param("horovod-gloo"), run_param("horovod-mpi")]


def saved_model(path, plain=False) -> str:
    """A model as broadcast_worker.py builds it, trained 3 steps with SGD momentum on one
    process (its momentum slots non-zero), saved as a .keras file; `plain`: Keras's SGD,
    else wrapped in dm.Optimizer."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(optimizer=sgd if plain else dm.Optimizer(sgd), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(12, 6)).astype("float32"), rng.normal(size=(12, 3)).astype("float32"),
              batch_size=4, epochs=1, shuffle=False, verbose=0)
    file = os.path.join(path, "plain.keras" if plain else "model.keras")
    model.save(file)
    return file


def ranks(run: str, tmp_path_factory) -> list:
    def start():
        out = tmp_path_factory.mktemp(f"broadcast-{run}")
        log = out / "log.txt"
        with open(log, "w") as f:
            rc = launcher.launch(run, 2, [os.path.join(proc.ROOT, WORKER), str(out), saved_model(out),
                                          saved_model(out, plain=True)],
                                 timeout=proc.JOB_TIMEOUT, out=f, child_output=f)
        assert rc == 0, log.read_text()[-5000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return jobs._once(("broadcast", run), start)


def assert_equal_on_every_rank(states: list) -> None:
    first = states[0]
    for other in states[1:]:
        assert len(other["weights"]) == len(first["weights"])
        for a, b in zip(first["weights"], other["weights"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert sorted(other["optimizer"]) == sorted(first["optimizer"])
        for key, value in first["optimizer"].items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(other["optimizer"][key]), err_msg=key)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("case", ["resume", "resume_fit"])
def test_a_loaded_model_and_a_fresh_one_end_with_every_optimizer_variable_of_the_root(run, case, tmp_path_factory):
    results = [r[case] for r in ranks(run, tmp_path_factory)]
    after = [r["after_broadcast"] for r in results]
    assert_equal_on_every_rank(after)
    momentum = [np.asarray(v) for k, v in after[0]["optimizer"].items() if k.endswith("/momentum")]
    assert len(momentum) == 4 and max(float(np.max(np.abs(m))) for m in momentum) > 1e-3  # the root's, sent
    assert after[0]["iterations"] == after[1]["iterations"] == 3  # the saved model's steps
    assert_equal_on_every_rank([r["after_steps"] for r in results])
    assert results[0]["after_steps"]["iterations"] == 6


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("case,named", [
    ("other_model", ["rank 1's variables differ from root rank 0's", "model.variables[2] of shape [5, 4]",
                     "model.variables[2] of shape [5, 3]", "nothing was broadcast"]),
    ("other_stack", ["the optimizer stack", "Lookahead > Optimizer > SGD", "Optimizer > SGD",
                     "nothing was broadcast"]),
    ("sharded_refused", ["shard_optimizer_state=True", "rank 0: 3, rank 1: 0", "dist_minimize.Checkpointer"]),
])
def test_another_structure_is_refused_on_every_rank(run, case, named, tmp_path_factory):
    for result in (r[case] for r in ranks(run, tmp_path_factory)):
        assert result["error"] is not None
        for text in named:
            assert text in result["error"], (text, result["error"])
        assert result["seconds"] < 30


@pytest.mark.parametrize("run", RUNS)
def test_sharded_state_broadcasts_what_every_rank_holds_and_shared_weights_stay_equal(run, tmp_path_factory):
    results = [r["sharded"] for r in ranks(run, tmp_path_factory)]
    for when in ("after_broadcast", "after_steps"):
        states = [r[when] for r in results]
        for a, b in zip(states[0]["weights"], states[1]["weights"]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        common = set(states[0]["optimizer"]) & set(states[1]["optimizer"])
        for key in common:
            np.testing.assert_array_equal(np.asarray(states[0]["optimizer"][key]),
                                          np.asarray(states[1]["optimizer"][key]), err_msg=key)
    # each slot of Adam is held by one rank: the shares are disjoint, and together whole
    held = [{k for k in r["after_steps"]["optimizer"] if "/" in k} for r in results]
    assert held[0] and held[1] and not held[0] & held[1]
    assert len(held[0] | held[1]) == 4 * 2  # momentum and velocity of 4 variables


@pytest.mark.parametrize("run", RUNS)
def test_load_model_wraps_a_plain_optimizer_and_the_ranks_train_alike(run, tmp_path_factory):
    """Every rank loads the file (a plain Keras SGD with momentum) with
    `dm.horovod_keras.load_model` and fits on its own rows: the gradients are averaged
    through Horovod, so the ranks stay equal; the file's momentum is kept."""
    results = [r["load_model"] for r in ranks(run, tmp_path_factory)]
    assert {r["optimizer"] for r in results} == {"Optimizer"}
    assert_equal_on_every_rank([r["after_load"] for r in results])
    momentum = [np.asarray(v) for k, v in results[0]["after_load"]["optimizer"].items() if k.endswith("/momentum")]
    assert len(momentum) == 4 and max(float(np.max(np.abs(m))) for m in momentum) > 1e-3
    assert_equal_on_every_rank([r["after_steps"] for r in results])
    assert results[0]["after_steps"]["iterations"] == 6
