"""The backend object (refdml._backend): what differs between NumPy and CuPy, one method each.

A backend whose host reads are not free (CuPy's) is built here over NumPy modules, so that
its side of each method runs in every session; the real CuPy side runs on the CuPy stand-in
and on a GPU through the operators that call these methods.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import scipy.special

from refdml._backend import Backend, get_backend


def _device_like() -> Backend:
    """CuPy's side of every method (host reads cost a synchronisation), over NumPy modules."""
    return Backend(name="device-like", xp=np, special=scipy.special, linalg=scipy.linalg,
                   free_host_reads=False, kernel_target="cuda", _scatter_add=np.add.at)


class _Unreadable:
    """A 0-d flag whose host read fails: a method that must not read it can be held to it."""

    def __bool__(self):
        raise AssertionError("the flag was read on the host")


# ---- for refdml.gpu.losses (and normalize, distances, histogram, prototypes, crossbatch)
def test_is_cached_recognises_only_the_kept_array():
    numpy_backend = get_backend(np.zeros(1))
    key = ("tests.base.test_backend.ones", 3)
    kept = numpy_backend.cached(key, lambda: np.ones(3))
    assert numpy_backend.is_cached(key, kept)
    assert not numpy_backend.is_cached(key, np.ones(3))               # equal, not the one kept
    assert not numpy_backend.is_cached(("tests.base.test_backend.absent",), None)
    assert not kept.flags.writeable
    device = _device_like()
    built = device.cached(key, lambda: np.ones(3))
    assert built is not device.cached(key, lambda: np.ones(3))        # built anew each time
    assert not device.is_cached(key, built)


def test_known_true_reads_the_flag_on_numpy_only():
    numpy_backend = get_backend(np.zeros(1))
    assert numpy_backend.known_true(np.isfinite(np.float64(1.0)))
    assert not numpy_backend.known_true(np.isfinite(np.float64(np.inf)))
    with pytest.raises(AssertionError, match="read on the host"):
        numpy_backend.known_true(_Unreadable())
    assert not _device_like().known_true(_Unreadable())


def test_refine_runs_on_numpy_and_is_skipped_where_host_reads_cost():
    calls = []

    def step(target, value):
        calls.append(value)
        target[...] = value

    target = np.zeros(2)
    get_backend(target).refine(step, target, 5.0)
    assert calls == [5.0] and np.all(target == 5.0)
    _device_like().refine(step, target, 7.0)
    assert calls == [5.0] and np.all(target == 5.0)
