"""scripts/torch_digits_collage.py: the plain-PyTorch digits-collage model with
refdml.torch's GSP layer and losses follows refdml.train's float64 loss trajectory (issue
49, point 4), and a wrong GSP gradient would make it leave that trajectory.

At batches of 8 classes x 4 collages (the study's P, half its K) to keep CI's torch leg
quick; the script's default is the study's batch of 64.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
STEPS = 20
CONFIG = {"n_samples_per_class": 4}
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def script():
    """scripts/torch_digits_collage.py, loaded from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("torch_digits_collage_under_test",
                                                  SCRIPTS / "torch_digits_collage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(script):
    """refdml.train's trajectory over STEPS steps, and the batches it trained on."""
    run = script.build_refdml_run(CONFIG)
    chosen = script.batches(run, STEPS)
    return chosen, script.refdml_losses(run, chosen)


def _torch_losses(script, chosen):
    run = script.build_refdml_run(CONFIG)     # the same seed: refdml's initial values
    return script.torch_losses(run, chosen, copy.deepcopy(run.objective.rng))


def _worst(ours, theirs) -> float:
    assert len(ours) == len(theirs) == STEPS
    assert np.all(np.isfinite(ours)) and np.all(np.isfinite(theirs))
    return max(abs(a - b) / abs(a) for a, b in zip(ours, theirs))


def test_the_pytorch_model_follows_refdml_train(script, reference):
    chosen, ours = reference
    assert _worst(ours, _torch_losses(script, chosen)) <= TOLERANCE
    # the trajectory moves: equal losses are not a model that never trained
    assert max(ours) - min(ours) > 1e-3


@pytest.fixture
def wrong_gsp_gradient(monkeypatch):
    """The prototypes' gradient of GSPPool made 1% wrong, through the op's own backward.

    Adam divides each coordinate's step by its own gradient scale, so a gradient scaled
    by a constant (1.01 g) would move the trajectory only through Adam's eps; the wrong
    gradient here mixes 1% of another prototype's gradient into each one's instead, a
    direction Adam cannot absorb.
    """
    from refdml._interop import bridged

    spec = bridged("gsp.pool")
    right = spec.backward

    def wrong(context, *upstream):
        grads = right(context, *upstream)
        return dataclasses.replace(grads, prototypes=grads.prototypes
                                   + 0.01 * grads.prototypes[::-1])

    # refdml.torch's registered backward calls the row's backward: replace it here.
    monkeypatch.setitem(vars(spec), "backward", wrong)


def test_a_wrong_gsp_gradient_leaves_the_trajectory(script, reference, wrong_gsp_gradient):
    chosen, ours = reference
    assert _worst(ours, _torch_losses(script, chosen)) > 1e3 * TOLERANCE


def test_main_prints_both_trajectories_and_exits_0(script, capsys):
    assert script.main(["--steps", "2", "--samples-per-class", "4"]) == 0
    out = capsys.readouterr().out
    assert "max relative difference" in out and "within the tolerance" in out
    assert [line.split()[0] for line in out.splitlines()[2:4]] == ["1", "2"]


def test_main_exits_1_when_the_trajectories_part(script, capsys, wrong_gsp_gradient):
    assert script.main(["--steps", "3", "--samples-per-class", "4"]) == 1
    assert "ABOVE the tolerance" in capsys.readouterr().out


def test_main_refuses_a_bad_flag(script, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.main(["--steps", "0"])
    assert exit_.value.code == 2
    assert "--steps == 0" in capsys.readouterr().err
