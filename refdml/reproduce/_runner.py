"""Run a grid of tasks on Dask (``dask.distributed``), with a disk cache and a progress bar.

:func:`run_tasks` takes the tasks (duplicates are run once), loads the cached ones, submits
the others to a Dask cluster (an embedded :class:`distributed.LocalCluster` of ``workers``
processes with one thread each, on loopback, or an existing scheduler at ``scheduler``) and
collects them with :func:`distributed.as_completed` under a tqdm bar. Each finished task is
written to the cache as soon as it arrives (so an interrupted run keeps it); a task that
raises is recorded with its traceback and the others go on. A worker that dies (killed,
out of memory) loses its running task: the scheduler re-runs it on another worker (Dask's
``distributed.scheduler.allowed-failures``, 3 by default, bounds how often a task may kill
workers before it is reported as failed). ``workers=0`` is refused; ``in_process=True``
runs the tasks one after the other in this process (the reference the tests compare with).

Threads: the nanny starts each worker with ``OMP_NUM_THREADS=1`` (and the MKL /
OpenBLAS equivalents; Dask's ``distributed.nanny.pre-spawn-environ``) and this module adds
``NUMBA_NUM_THREADS=1`` (refdml.gpu's ``parallel=True`` CPU kernels), so ``N`` workers use
``N`` cores. The embedded cluster's nanny does not set Dask's default
``MALLOC_TRIM_THRESHOLD_=65536`` (:data:`_NOT_PRE_SPAWN`): it makes glibc hand freed memory
back to the system at once, so a training step's arrays are page-faulted in again at every
step, and a training run spends much of its time in system calls (docs/reproduce.md has
the measurement). Workers of an external ``--scheduler`` are configured by whoever started them. The
scheduler's HTTP server (Dask's dashboard, when bokeh is installed) listens on a free
loopback port, so several runs (or a run and the tests) can share a machine.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

from refdml.exceptions import MissingExtraError
from refdml.reproduce._cache import TaskCache
from refdml.reproduce._tasks import Task, execute, task_key

__all__ = ["Outcome", "run_tasks"]


@dataclass
class Outcome:
    """What a run of tasks produced: results, failures (traceback text), what was cached."""

    results: dict[Task, dict] = field(default_factory=dict)
    failures: dict[Task, str] = field(default_factory=dict)
    cached: set = field(default_factory=set)
    computed: set = field(default_factory=set)
    missing: set = field(default_factory=set)   # not cached and not computed (compute=False)


def _format(exc: BaseException, tb: Any = None) -> str:
    return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None
                                              else exc.__traceback__))


def run_tasks(tasks, *, workers: int | None = 2, scheduler: str | None = None,
              cache_dir=None, progress: bool = True, in_process: bool = False,
              compute: bool = True) -> Outcome:
    """Run ``tasks`` (see the module docstring); returns an :class:`Outcome`.

    ``compute=False`` only loads the cache: the other tasks are left in ``missing`` (a
    report of what a running or interrupted run has finished so far).
    """
    from tqdm import tqdm

    unique = list(dict.fromkeys(tasks))
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"workers == {workers!r}, must be an integer >= 1")
    cache = TaskCache(cache_dir)
    out = Outcome()
    todo = []
    for task in unique:
        result = cache.load(task)
        if result is None:
            todo.append(task)
        else:
            out.results[task] = result
            out.cached.add(task)
    if not compute:
        out.missing.update(todo)
        todo = []
    bar = tqdm(total=len(unique), initial=len(unique) - len(todo), desc="tasks", unit="task",
               disable=None if progress else True, dynamic_ncols=True)

    def finish(task: Task, result: dict | None, failure: str | None) -> None:
        if failure is None:
            out.results[task] = result
            out.computed.add(task)
            cache.store(task, result)
        else:
            out.failures[task] = failure
            bar.write(f"task {task.label()} FAILED:\n{failure}")
        bar.update(1)
        bar.set_postfix(failed=len(out.failures))

    try:
        if not todo:
            return out
        if in_process:
            for task in todo:
                try:
                    result = execute(task)
                except Exception as exc:  # reported, the others go on
                    finish(task, None, _format(exc))
                else:
                    finish(task, result, None)
            return out
        _run_dask(todo, workers, scheduler, finish)
        return out
    finally:
        bar.close()


#: Variables of Dask's ``distributed.nanny.pre-spawn-environ`` that the embedded cluster
#: leaves unset (glibc's own, adaptive malloc thresholds instead; module docstring).
_NOT_PRE_SPAWN = ("MALLOC_TRIM_THRESHOLD_",)


def _pre_spawn_environ() -> dict:
    """Dask's pre-spawn environment for the nanny, less :data:`_NOT_PRE_SPAWN`."""
    import dask

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    return {k: v for k, v in environ.items() if k not in _NOT_PRE_SPAWN}


def _run_dask(todo: list[Task], workers: int | None, scheduler: str | None, finish) -> None:
    try:
        import dask
        from distributed import Client, LocalCluster, as_completed
    except ImportError as exc:  # the "reproduce" extra
        raise MissingExtraError("reproduce", (exc.name or "distributed").split(".")[0]) from exc

    cluster = None
    if scheduler is None:
        with dask.config.set({"distributed.nanny.pre-spawn-environ": _pre_spawn_environ()}):
            cluster = LocalCluster(n_workers=workers or 1, threads_per_worker=1,
                                   processes=True, host="127.0.0.1",
                                   dashboard_address="127.0.0.1:0",
                                   silence_logs=logging.ERROR, env={"NUMBA_NUM_THREADS": "1"})
        client = Client(cluster)
    else:
        client = Client(scheduler)
    try:
        futures = {}
        for task in todo:
            future = client.submit(execute, task, key=f"refdml-task-{task_key(task)}",
                                   pure=False)
            futures[future] = task
        for future in as_completed(futures):
            task = futures[future]
            # result() rather than the status: a finished task whose worker is then lost goes
            # back to pending and is recomputed elsewhere, and result() waits for that.
            try:
                result = future.result()
            except Exception as exc:  # the task's own error, or a worker lost for good
                remote = future.traceback() if future.status == "error" else None
                finish(task, None, _format(exc, remote))
                continue
            finish(task, result, None)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
