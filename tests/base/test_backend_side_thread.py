"""refdml._backend's side thread: Backend.alongside, Backend.halves and side_thread.

What is asserted: outside :func:`side_thread` (and on a backend whose host reads are not
free, as CuPy's) the work runs at once in the caller's thread; inside, on the one worker
thread, with the caller's context, and a job handed on by the worker runs at once (no
wait on a job queued behind itself); errors reach ``.result()`` either way; ``halves``
runs two halves on NumPy (one beside) and the whole once on a device; a forked
child gets a worker of its own; and the flag is checked by name.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from refdml._backend import Backend, get_backend, hand_operator_checks_to_step, side_thread

NUMPY = get_backend(np.zeros(1))


def _thread_name() -> str:
    return threading.current_thread().name


def test_outside_the_block_the_work_runs_at_once_in_the_caller():
    pending = NUMPY.alongside(_thread_name)
    assert pending.done()
    assert pending.result() == _thread_name()
    with side_thread(False):
        assert NUMPY.alongside(_thread_name).result() == _thread_name()


def test_inside_the_block_the_work_runs_on_the_side_thread():
    with side_thread():
        name = NUMPY.alongside(_thread_name).result()
        product = NUMPY.alongside(np.matmul, np.eye(3), np.arange(9.0).reshape(3, 3)).result()
    assert name.startswith("refdml-side") and name != _thread_name()
    np.testing.assert_array_equal(product, np.arange(9.0).reshape(3, 3))   # exact: I x
    # The setting is this thread's own: another thread outside any block runs at once.
    seen = []
    with side_thread():
        other = threading.Thread(target=lambda: seen.append(NUMPY.alongside(_thread_name)
                                                            .result()))
        other.start()
        other.join()
    assert seen == [other.name]


def test_a_device_backend_runs_the_work_at_once_even_inside_the_block():
    # A backend whose host reads synchronise (CuPy's): its current stream is per thread, so
    # the work stays in the caller's thread, in order.
    device_like = _device_like()
    with side_thread():
        pending = device_like.alongside(_thread_name)
        assert pending.done() and pending.result() == _thread_name()


@pytest.mark.parametrize("enabled", [False, True])
def test_an_error_reaches_result(enabled):
    def fails():
        raise ArithmeticError("from the side")

    with side_thread(enabled):
        pending = NUMPY.alongside(fails)
        with pytest.raises(ArithmeticError, match="from the side"):
            pending.result()
        # The worker survives a failed job.
        assert NUMPY.alongside(_thread_name).result().startswith(
            "refdml-side" if enabled else _thread_name())


def test_the_side_job_sees_the_callers_settings_and_hands_nothing_on():
    from refdml._backend import _CHECKS_HANDED_TO_STEP

    def nested():
        # Handed on from the side thread, it runs at once there (a second job queued to
        # the one busy worker would wait for ever).
        inner = NUMPY.alongside(_thread_name)
        return _CHECKS_HANDED_TO_STEP.get(), inner.done(), inner.result(), _thread_name()

    with side_thread(), hand_operator_checks_to_step():
        pending = NUMPY.alongside(nested)
        handed, inner_done, inner_name, outer_name = pending.result(timeout=60)
    assert handed is True
    assert inner_done and inner_name == outer_name and outer_name.startswith("refdml-side")


def _device_like() -> Backend:
    return Backend(name="device-like", xp=np, special=NUMPY.special, linalg=NUMPY.linalg,
                   free_host_reads=False, kernel_target="cuda", _scatter_add=np.add.at)


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("size", [0, 1, 2, 5])
def test_halves_cover_the_batch_once(enabled, size):
    calls = []
    with side_thread(enabled):
        NUMPY.halves(lambda part: calls.append((part, _thread_name())), size)
    covered = sorted(i for part, _ in calls for i in range(size)[part])
    assert covered == list(range(size))
    if size >= 2:
        assert sorted(part.start for part, _ in calls) == [0, (size + 1) // 2]
        threads = {name for _, name in calls}
        assert (threads == {_thread_name()}) is (not enabled)
    else:
        assert calls == [(slice(0, size), _thread_name())]


@pytest.mark.parametrize("enabled", [False, True])
def test_halves_return_their_results_in_order_and_joined_puts_them_together(enabled):
    values = np.arange(7.0)
    with side_thread(enabled):
        parts = NUMPY.halves(lambda part: values[part] * 2.0, 7)
    assert [len(p) for p in parts] == [4, 3]
    np.testing.assert_array_equal(NUMPY.joined(parts), values * 2.0)   # exact: doubling
    whole = _device_like().halves(lambda part: values[part], 7)
    assert len(whole) == 1 and _device_like().joined(whole) is whole[0]   # no copy


def test_a_device_backend_runs_the_whole_batch_at_once():
    calls = []
    with side_thread():
        _device_like().halves(lambda part: calls.append((part, _thread_name())), 6)
    assert calls == [(slice(0, 6), _thread_name())]


@pytest.mark.parametrize("failing", [0, 3])
def test_an_error_in_either_half_is_raised_after_both_ran(failing):
    ran = []

    def work(part):
        ran.append(part.start)
        if part.start == failing:
            raise FloatingPointError(f"half at {part.start}")

    with side_thread(), pytest.raises(FloatingPointError, match=f"half at {failing}"):
        NUMPY.halves(work, 6)
    assert sorted(ran) == [0, 3]


@pytest.mark.parametrize("enabled", [1, "yes", None])
def test_the_flag_is_checked_by_name(enabled):
    with pytest.raises(TypeError, match=rf"enabled must be a bool, got {enabled!r}"):
        with side_thread(enabled):
            pass


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="os.fork: POSIX only")
def test_a_forked_child_gets_a_worker_of_its_own():
    # The parent's worker thread is not copied into a child; without the at-fork reset the
    # child's first job would queue to a thread that does not exist and never return.
    script = textwrap.dedent("""
        import os, sys, threading
        import numpy as np
        from refdml._backend import get_backend, side_thread
        backend = get_backend(np.zeros(1))
        name = lambda: threading.current_thread().name
        with side_thread():
            assert backend.alongside(name).result().startswith("refdml-side")
            pid = os.fork()
            if pid == 0:
                try:
                    ok = backend.alongside(name).result(timeout=30).startswith("refdml-side")
                except Exception:
                    ok = False
                os._exit(0 if ok else 3)
            _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
