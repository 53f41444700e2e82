"""Every method of every experiment runs (one training epoch on the quick settings' data,
small models), returns finite metrics, and the same numbers twice (a task is a pure
function of its spec)."""

import math

import pytest

from refdml.reproduce import EXPERIMENTS, execute
from refdml.reproduce._experiments import settings_for

_SMALL = {
    "collage": {"epochs": 1, "conv_channels": [2, 2], "local_dim": 4, "embedding_dim": 4,
                "n_prototypes": 4, "proxies_per_class": 2, "budget": 3, "transfer_repeats": 2,
                "instance_every": 1},
    "tokens": {"epochs": 1, "n_train_per_class": 4, "n_test_per_class": 2},
    "wdml": {"epochs": 1, "n_train_per_class": 4, "n_test_per_class": 2,
             "tokens_per_sample": 4, "sinkhorn_iter": 5},
}


def _runs():
    seen = {}
    for e in EXPERIMENTS.values():
        for label, (method, overrides) in e.runs.items():
            seen.setdefault((e.study, method, overrides.get("loss")), overrides)
    return sorted(seen.items(), key=str)


@pytest.mark.parametrize("key, overrides", _runs(), ids=lambda v: "-".join(map(str, v))
                         if isinstance(v, tuple) else "")
def test_every_method_runs_and_is_deterministic(key, overrides):
    from refdml.reproduce import Task

    study, method, _ = key
    task = Task.make(study, method, 0, settings_for(study, "quick", **overrides,
                                                    **_SMALL[study]))
    first = execute(task)
    assert first["metrics"] and all(math.isfinite(v) for v in first["metrics"].values())
    assert execute(task)["metrics"] == first["metrics"]
