"""ci/mutations.py changes code by exact text; each text must still be found exactly once
in the package, or the script would stop (it refuses to test nothing). This keeps the
mutations in step with refactors, without running them (they take 20 minutes)."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_mutations():
    spec = importlib.util.spec_from_file_location("dm_mutations", os.path.join(ROOT, "ci", "mutations.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


MUTATIONS = load_mutations().MUTATIONS


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_text_is_found_exactly_once(mutation):
    text = open(os.path.join(ROOT, mutation.path)).read()
    for old, new in mutation.edits():
        assert text.count(old) == 1, f"{mutation.name}: {old!r} occurs {text.count(old)} times in {mutation.path}"
        assert old != new
    for test in mutation.tests:
        assert os.path.exists(os.path.join(ROOT, test.split("::")[0])), test
