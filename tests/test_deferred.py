"""refdml._deferred: device values read later, in one transfer, with nothing dropped.

On NumPy (every session) and on the CuPy stand-in (REFDML_CUPY_STANDIN=1), where the
number of host reads is counted.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from refdml import _deferred
from refdml._backend import get_backend
from refdml.exceptions import NonFiniteGradient


def _xp():
    cupy = sys.modules.get("cupy")
    return cupy if getattr(cupy, "__refdml_standin__", False) else np


def test_read_calls_back_in_order_with_the_values_and_where():
    xp = _xp()
    reads = _deferred.DeferredReads()
    seen = []
    reads.where = "step 1"
    reads.add(xp.asarray([1.0, 2.0]), lambda v, w: seen.append(("a", v.tolist(), w)))
    reads.where = "step 2"
    reads.add((xp.asarray(True), xp.asarray(7)), lambda v, w: seen.append(("b", v.tolist(), w)))
    assert len(reads) == 2 and seen == []
    reads.read()
    assert seen == [("a", [1.0, 2.0], "step 1"), ("b", [1.0, 7.0], "step 2")]
    assert reads.reads == 1 and len(reads) == 0
    reads.read()                     # nothing pending: no read
    assert reads.reads == 1


def test_every_callback_runs_and_the_first_failure_is_raised_once():
    reads = _deferred.DeferredReads()
    ran = []

    def fail(label):
        def on_read(values, where):
            ran.append(label)
            raise ValueError(label)
        return on_read

    reads.add(np.zeros(1), fail("first"))
    reads.add(np.zeros(1), lambda values, where: ran.append("between"))
    reads.add(np.zeros(1), fail("second"))
    with pytest.raises(ValueError, match="^first$"):
        reads.read()
    assert ran == ["first", "between", "second"] and len(reads) == 0
    reads.read()                     # not raised twice


def test_add_refuses_what_is_not_an_array_or_a_callback():
    reads = _deferred.DeferredReads()
    with pytest.raises(TypeError, match="on_read must be callable"):
        reads.add(np.zeros(1), None)
    with pytest.raises(TypeError, match="values must be an array"):
        reads.add([1.0], lambda v, w: None)
    with pytest.raises(TypeError, match="reads must be a DeferredReads"):
        with _deferred.deferring(object()):
            pass


def test_outside_a_scope_a_check_runs_at_once_and_names_the_first_bad_index():
    xp = _xp()
    x = xp.asarray(np.array([[1.0, 2.0, np.inf], [np.nan, 0.0, 1.0]]))
    with pytest.raises(NonFiniteGradient, match=r"d_y is not finite .* at index \(0, 2\)$"):
        _deferred.check_finite_later(x, "d_y")
    assert bool(_deferred.check_finite_later(xp.ones((2, 2)), "d_y"))


def test_inside_a_scope_a_check_waits_for_the_read_and_names_where():
    xp = _xp()
    reads = _deferred.DeferredReads()
    x = xp.asarray(np.array([1.0, np.nan, np.nan]))
    if get_backend(x).free_host_reads:              # NumPy: read at once, even in a scope
        with _deferred.deferring(reads), pytest.raises(NonFiniteGradient, match=r"\(1,\)$"):
            _deferred.check_finite_later(x, "loss gradient")
        assert len(reads) == 0 and get_backend(x).data_checks
        pytest.skip("NumPy reads at once (checked above); the deferral needs the CuPy stand-in")
    with _deferred.deferring(reads):
        reads.where = "epoch 1, step 4"
        finite = _deferred.check_finite_later(x, "loss gradient")
        assert len(reads) == 1
        assert not get_backend(x).data_checks           # the operators' checks handed over
    assert get_backend(x).data_checks                  # given back at the scope's end
    with pytest.raises(NonFiniteGradient,
                       match=r"loss gradient is not finite .* index \(1,\) at epoch 1, step 4"):
        reads.read()
    assert not bool(xp.asnumpy(finite))


def test_operator_checks_stay_on_when_asked():
    xp = _xp()
    x = xp.ones(2)
    with _deferred.deferring(_deferred.DeferredReads(), operator_checks=True):
        assert get_backend(x).data_checks


def test_read_now_takes_the_scopes_pending_values_along_in_one_read():
    # A caller that must decide on a value now (the GSP layer's backward) pays one read, and
    # what waits in the scope comes with it: its callbacks run first, and a failure among them
    # is raised after every callback, the caller's included, has run.
    xp = _xp()
    seen = []
    reads = _deferred.DeferredReads()
    with _deferred.deferring(reads, operator_checks=True):
        reads.where = "forward"
        _deferred.read_later(xp.asarray([3.0]), lambda v, w: seen.append(("later", v.tolist(), w)))
        reads.where = "backward"
        _deferred.read_now(xp.asarray([4.0, 5.0]), lambda v, w: seen.append(("now", v.tolist(), w)))
        device = not get_backend(xp.ones(1)).free_host_reads
        # NumPy reads each at once (the "later" one at its call); a device reads both at the
        # second call, in one transfer
        assert seen == [("later", [3.0], "" if not device else "forward"),
                        ("now", [4.0, 5.0], "" if not device else "backward")], seen
        assert len(reads) == 0 and reads.reads == (1 if device else 0)
        del seen[:]

        def refuse(values, where):
            raise ValueError(f"refused at {where}")

        with pytest.raises(ValueError, match="refused at"):
            _deferred.read_later(xp.asarray([1.0]), refuse)   # NumPy: refused here, at once
            _deferred.read_now(xp.asarray([6.0]), lambda v, w: seen.append(v.tolist()))
        assert seen == ([[6.0]] if device else [])
    assert len(reads) == 0
