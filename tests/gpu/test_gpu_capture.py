"""The captured training step replayed as a real CUDA graph (issue 46, lever 5), on a GPU.

``TrainingLoop(capture=True)`` records the device step once per shape with CuPy's stream
capture and replays it (refdml.train._capture). On the CuPy stand-in nothing can be
replayed (tests/train/test_train_capture.py checks the step's capture-safety there); here a
real graph is launched, so these tests check what only a GPU can: that CuPy's and Numba's
launches land in the graph (on the capture stream), that the private pool and the staged
buffers keep the recorded addresses valid, and that replays follow the uncaptured
trajectory. Run by scripts/gpu_run.sh's test step (every tests/gpu/test_gpu*.py); the
timing of replay against the uncaptured step is scripts/bench_gpu.py ``--capture``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

pytestmark = [
    pytest.mark.requires_cupy,
    pytest.mark.skipif(getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
                       reason="replays a real CUDA graph: the CuPy stand-in records none "
                              "(tests/train/test_train_capture.py runs there)"),
]

#: float32 steps of the same kernels, replayed or launched one by one: equal but for the
#: order of atomic additions (col2im's scatter_add, the optimiser's first-bad minimum is
#: exact), a few units of roundoff per step.
RTOL = 1e-5


def _host(loop):
    from refdml._backend import to_numpy

    return {name: np.array(to_numpy(p.value)) for name, p in loop.parameters.items()}


def test_a_replayed_token_model_follows_the_uncaptured_loop():
    sys.path.insert(0, str(Path(__file__).parents[1] / "train"))   # the loop tests' pieces
    from test_train_loop import _device_pieces, _loop

    results = {}
    for capture in (False, True):
        loop = _loop(None, epochs=3, log_every=3, capture=capture, **_device_pieces())
        rows = loop.fit()
        results[capture] = (_host(loop), [row["train_loss"] for row in rows[1:]], loop)
    counts = results[True][2]._step_capture.counts
    assert counts == {"uncaptured": 2, "captured": 1, "replayed": 9}, counts
    assert_allclose(results[True][1], results[False][1], rtol=RTOL)
    for name, value in results[False][0].items():
        assert_allclose(results[True][0][name], value, rtol=RTOL, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("n_steps", [6])
def test_a_replayed_digits_collage_step_follows_the_uncaptured_one(n_steps):
    # GSP's head and objective under "auto" (Numba's kernels on CuPy's capture stream, the
    # zero-shot split staged): replays 3 times after two warm-ups and the capture. A
    # CuPy that cannot capture a library call of the step (cuSOLVER's Cholesky factor of
    # the cross fit) fails here, at the capture, naming it.
    from refdml.gpu import use_kernels
    from refdml.train.runs import build_run

    results = {}
    for capture in (False, True):
        with tempfile.TemporaryDirectory() as out_dir:
            run = build_run("digits-collage", dict(
                dtype="float32", device="cuda", epochs=0, progress=False,
                n_classes_per_batch=4, n_samples_per_class=4), out_dir=out_dir)
        loop = run.trainer
        loop.capture, loop.log_every = capture, n_steps
        loop.train_sampler = _first_batches(loop.train_sampler, n_steps)
        with use_kernels("auto"):
            loss = loop._train_epoch(1)
        results[capture] = (_host(loop), loss, loop)
    counts = results[True][2]._step_capture.counts
    assert counts == {"uncaptured": 2, "captured": 1, "replayed": n_steps - 3}, counts
    assert_allclose(results[True][1], results[False][1], rtol=RTOL)
    for name, value in results[False][0].items():
        assert_allclose(results[True][0][name], value, rtol=RTOL, atol=1e-6, err_msg=name)


class _first_batches:
    """The sampler's first ``n`` batches of each epoch (a short epoch of full batches)."""

    def __init__(self, sampler, n):
        self.sampler, self.n = sampler, n
        self._labels = sampler._labels

    def __len__(self):
        return self.n

    def __iter__(self):
        for index, batch in enumerate(self.sampler):
            if index == self.n:
                return
            yield batch
