r"""A training step recorded once as a CUDA graph and replayed.

:class:`StepCapture` runs the device step of :class:`~refdml.train.TrainingLoop` with
``capture=True``. A replayed graph runs the device work of the recorded step with the
addresses it was recorded with and **no Python**: every per-step Python effect inside the
recorded region would happen once, at the capture. So the step is split in two:

- **Before the captured region** (host Python, every step): the batch's inputs and labels
  and whatever the objective draws on the host for the step (:meth:`host_draws`: GSP's
  zero-shot split, from its generator exactly as its forward would draw it) are computed,
  and every host array the step would upload is copied into a fixed device buffer
  (:class:`refdml._deferred.StagedUploads`: one buffer per key, shape and dtype, the same
  pointer every step; the objective lists its own in :meth:`staged_uploads`).
- **The captured region** (the same code as the uncaptured device step: zero_grad, model
  forward, objective forward and backward, the loss and gradient checks, model backward,
  the fused optimiser step): it reads nothing back, uploads nothing (a step's own upload
  finds its staged buffer, :func:`refdml._deferred.staged_upload`, and an unstaged one is
  :class:`~refdml._deferred.CaptureUnsafe`), and allocates only from CuPy's memory pool
  (a private pool kept with the graph). What it would hand to
  :func:`~refdml._deferred.read_later` (the check slots, the optimiser's status, GSP's
  solve summary) and the loss are written, in one concatenate, into row ``counter`` of a
  device **ring** of ``log_every`` rows, and ``counter`` (on the device) is incremented:
  each replay writes its own row. The records made while capturing are kept as templates
  (their sizes and callbacks); for each replay the host adds one deferred read of that
  step's ring row, labelled with the step, whose callback hands each template its part.
  Nothing is dropped: a failure is raised at the next read, naming its epoch and step as
  for an uncaptured step. The optimiser's callbacks read the step's number from the
  device's step count in the row, not from Python state of the recorded step.

Shapes: a graph is recorded per **key**: the shapes and dtypes of the inputs and labels,
the count of each boolean draw (a split's first half has as many rows; it sizes slices)
and the optimiser's :meth:`~refdml.train.optim.Optimizer.capture_key` (learning rates,
offsets: a new rate uploads a new plan, which an older graph would not read). A key is
run uncaptured ``warmup`` times first (lazy state: kept constants, check slots, the
optimiser's plan; CuPy's and Numba's kernels compiled), then captured; a key seen fewer
times (the epoch's last, shorter batch) runs uncaptured, and so does every step while a
parameter is frozen (a frozen parameter's step offset moves every step). At most
``max_graphs`` graphs are kept (the oldest dropped).

Numba's kernels: refdml's ``cuda_launch`` launches each on the stream its arguments were
exported on (``__cuda_array_interface__``'s ``stream``: CuPy's current stream), so they go
to the capture stream the step runs on; ``REFDML_CUDA_LAUNCH_SYNC=1`` (numba-cuda's own
launch, on the legacy stream) is refused. The products and Cholesky solves run
:mod:`refdml.gpu.linalg`'s kernels inside the capture (CuPy refuses cuBLAS and cuSOLVER
there) and its array path outside, so their kernels' first use would be the capture: they
are compiled and loaded beforehand (:func:`refdml.gpu.linalg.warm_up`, before the first
capture).

Keeping memory alive: the graph keeps its private memory pool (the capture run's
temporaries stay there, so nothing else is ever given those addresses), its ring and
counter, the staged buffers and the device constants the step read (the backend's kept
constants, the check slots, the optimiser's plan and constants).

Where device memory is host memory (refdml's CuPy stand-in, which runs the kernels at
once and records none), there is nothing to replay: each "replay" runs the step's Python
again inside a capture of the stand-in, which refuses host reads, uploads, allocations
outside the pool and work on another stream, and writes the ring row as the graph would;
its records must have the shapes the recorded ones had. So every replayed step on the
stand-in is checked as the capture was, and the ring, the templates and the device-side
step numbers carry the results as they do on a GPU. Whether a replay on a GPU beats the
uncaptured step is measured there (scripts/bench_gpu.py ``--capture``), not here.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from refdml._backend import device_memory_on_host, get_backend
from refdml._deferred import (CaptureUnsafe, DeferredReads, StagedUploads, deferring,
                              staging)
from refdml.gpu import linalg

__all__ = ["StepCapture"]


class _Graph:
    """One recorded step: the graph (None on the stand-in), its ring of rows and device
    row counter, the templates of its records and what it keeps alive."""

    def __init__(self, ring: Any, counter: Any) -> None:
        self.ring, self.counter = ring, counter
        self.rows = 0                     # rows written since the last read (host count)
        self.sizes: list[int] = []        # per template: its values' size
        self.templates: list[Callable[[np.ndarray, str], None]] = []
        self.executable: Any = None
        self.keep: list[Any] = []
        self.captures = 0                 # stand-in: the captures run (the first and replays)
        self.launches = 0                 # launches counted in the last capture (stand-in)


def _sizes(records) -> list[int]:
    return [sum(int(np.prod(a.shape, dtype=np.int64)) for a in arrays)
            for arrays, _, _ in records]


class StepCapture:
    """The captured device step of one :class:`~refdml.train.TrainingLoop` (module
    docstring). ``warmup``: uncaptured steps of a key before it is captured; ``max_graphs``:
    graphs kept at most."""

    def __init__(self, loop: Any, *, warmup: int = 2, max_graphs: int = 4) -> None:
        if os.environ.get("REFDML_CUDA_LAUNCH_SYNC", "0") == "1":
            # refdml.gpu._support.launch then launches Numba's kernels as numba-cuda does by
            # default, on the legacy stream: outside the capture stream, not in the graph
            raise CaptureUnsafe("REFDML_CUDA_LAUNCH_SYNC=1 launches the CUDA kernels on the "
                                "legacy default stream, which a captured step cannot record; "
                                "unset it to capture the step")
        self.loop = loop
        xp = loop._xp
        self.xp = xp
        self.stage = StagedUploads(xp)
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.replays = not device_memory_on_host()
        self.warmup, self.max_graphs = warmup, max_graphs
        self.graphs: dict[Any, _Graph] = {}
        self._warmed = False
        self._seen: collections.Counter = collections.Counter()
        self._widths: dict[Any, list[int]] = {}
        #: steps run: "uncaptured", "captured" (the capture runs), "replayed"
        self.counts: collections.Counter = collections.Counter()

    # -- the epoch's stream ---------------------------------------------------------
    def enter(self) -> Any:
        """Order the capture stream after the caller's stream and make it current (CuPy's
        capture needs a non-blocking stream; the step's kernels, Numba's included, go
        where CuPy's current stream is); returns what :meth:`leave` takes."""
        outer = self.xp.cuda.get_current_stream()
        self.stream.wait_event(outer.record())
        self.stream.__enter__()
        return outer

    def leave(self, outer: Any) -> None:
        self.stream.__exit__(None, None, None)
        outer.wait_event(self.stream.record())

    # -- one step ---------------------------------------------------------------------
    def step(self, inputs: np.ndarray, labels: np.ndarray, reads: DeferredReads,
             on_loss: Callable[[float], None]) -> str:
        """Run one step on host ``inputs`` (the loop's dtype) and ``labels``; its checks and
        loss go to ``reads`` (``on_loss`` gets the loss when read). Returns how it ran:
        ``"uncaptured"``, ``"captured"`` or ``"replayed"``."""
        loop = self.loop
        objective = loop.objective
        draws = objective.host_draws(labels) if callable(
            getattr(objective, "host_draws", None)) else {}
        key = self._key(inputs, labels, draws)
        x = self._stage(inputs, labels, draws)
        graph = self.graphs.get(key)
        if graph is None:
            self._seen[key] += 1
            if (self._seen[key] <= self.warmup or loop.optimizer._frozen
                    or key not in self._widths):
                self._uncaptured(key, x, labels, draws, reads, on_loss)
                return self._count("uncaptured")
            graph = self._capture(key, x, labels, draws)
            if self.replays:               # the capture ran nothing on a GPU: run it once
                graph.executable.launch(self.stream)
            self._row(graph, reads, on_loss)
            return self._count("captured")
        if self.replays:
            graph.executable.launch(self.stream)
            loop.optimizer.replayed_step()      # its Python did not run
        else:                                   # the stand-in: run it again, captured
            self._run_captured(graph, x, labels, draws, check=True)
        self._row(graph, reads, on_loss)
        return self._count("replayed")

    def after_read(self) -> None:
        """The rows were read: the rings start again at row 0 (a fill of each counter,
        outside any captured region)."""
        for graph in self.graphs.values():
            if graph.rows:
                graph.counter.fill(0)
                graph.rows = 0

    # -- the parts -----------------------------------------------------------------------
    def _count(self, how: str) -> str:
        self.counts[how] += 1
        return how

    def _key(self, inputs: np.ndarray, labels: np.ndarray, draws: dict) -> tuple:
        drawn = tuple(sorted(
            (name, tuple(np.shape(value)), int(np.count_nonzero(value))
             if np.asarray(value).dtype == bool else None)
            for name, value in draws.items()))
        return (inputs.shape, inputs.dtype.str, labels.shape, labels.dtype.str, drawn,
                self.loop.optimizer.capture_key())

    def _stage(self, inputs: np.ndarray, labels: np.ndarray, draws: dict) -> Any:
        """Copy the step's host data into the staged buffers (uploads, outside the captured
        region); returns the inputs' buffer."""
        stage = self.stage
        x = stage.put("inputs", inputs)
        stage.put("labels", labels)
        staged = getattr(self.loop.objective, "staged_uploads", None)
        if callable(staged):
            for key, host in staged(labels, **draws).items():
                stage.put(key, host)
        return x

    def _body(self, x: Any, labels: np.ndarray, draws: dict) -> Any:
        """The device step, as the uncaptured loop runs it (zero_grad first, so that the
        recorded step starts from cleared gradients whatever ran before it)."""
        loop = self.loop
        loop.optimizer.zero_grad()
        outputs, ctx = loop.model.forward(x)
        value, objective_ctx = loop.objective.forward(outputs, labels, **draws)
        if not get_backend(x).is_own_array(value):
            # Checked before the update: the first (uncaptured) step stops unapplied.
            name = getattr(loop.objective, "name", type(loop.objective).__name__)
            raise CaptureUnsafe(
                f"the objective {name!r} "
                f"returned its loss as a host number ({type(value).__name__}), read from "
                "the device inside the step, which a captured step cannot do (it reads "
                "nothing back); train this objective with capture=False")
        loop._device_step(value, objective_ctx, ctx)
        return value

    def _uncaptured(self, key, x, labels, draws, reads, on_loss) -> None:
        """A warm-up or fallback step: its records go to ``reads`` as they were made (after
        the loss's), and their sizes are noted for the key's ring."""
        mine = DeferredReads()
        mine.where = reads.where
        with staging(self.stage), deferring(mine):
            value = self._body(x, labels, draws)
            records = mine.take()
        reads.add(value, lambda values, where: on_loss(float(values[0])))
        for arrays, on_read, _ in records:
            reads.add(arrays, on_read)
        self._widths[key] = _sizes(records)

    def _capture(self, key, x, labels, draws) -> _Graph:
        xp = self.xp
        if not self._warmed:       # the products' kernels: compiled and loaded uncaptured
            linalg.warm_up(get_backend(x))
            self._warmed = True
        sizes = self._widths[key]
        graph = _Graph(xp.zeros((self.loop.log_every, 1 + sum(sizes)), dtype=np.float64),
                       xp.zeros(1, dtype=np.int64))
        if len(self.graphs) >= self.max_graphs:
            del self.graphs[next(iter(self.graphs))]
        graph.executable, records = self._run_captured(graph, x, labels, draws,
                                                       private_pool=self.replays)
        graph.sizes = _sizes(records)
        if graph.sizes != sizes:
            raise CaptureUnsafe(f"the captured step recorded reads of sizes {graph.sizes}, "
                                f"its uncaptured runs {sizes}: it is not the same step")
        graph.templates = [on_read for _, on_read, _ in records]
        optimizer = self.loop.optimizer
        backend = get_backend(x)
        # What the recorded kernels read by address, kept as long as the graph: the
        # staged buffers, the backend's kept constants (Backend.kept may drop its oldest),
        # the loop's check slots and the optimiser's plans and constants.
        graph.keep = [self.stage.buffers(), backend.kept_arrays(),
                      dict(self.loop._slots),
                      [(flat._plan, flat._scalars) for flat in optimizer._flats]]
        self.graphs[key] = graph
        return graph

    def _run_captured(self, graph: _Graph, x, labels, draws, *, private_pool: bool = False,
                      check: bool = False):
        """The step between ``begin_capture`` and ``end_capture`` on the capture stream,
        with its ring row written; returns ``(graph, records)``. ``check``: a stand-in
        replay, whose records must have the recorded sizes."""
        xp = self.xp
        objective = self.loop.objective
        state = objective.state_dict() if callable(
            getattr(objective, "state_dict", None)) else None
        pool = xp.cuda.MemoryPool() if private_pool else None
        mine = DeferredReads()
        self.stage.capturing = True
        self.stream.begin_capture()
        try:
            with (xp.cuda.using_allocator(pool.malloc) if pool is not None
                  else contextlib.nullcontext()), staging(self.stage), deferring(mine):
                value = self._body(x, labels, draws)
                records = mine.take()
                arrays = [value] + [a for group, _, _ in records for a in group]
                row = xp.concatenate([xp.reshape(a, (-1,)) for a in arrays],
                                     dtype=np.float64)
                graph.ring[graph.counter] = row[None]
                graph.counter += 1
        except BaseException as error:
            self.stage.capturing = False
            try:
                self.stream.end_capture()
            except Exception:      # noqa: BLE001 - a failed capture may not end cleanly
                pass
            if isinstance(error, NotImplementedError) and "stream capture" in str(error):
                # CuPy's refusal of a cuBLAS, cuSOLVER or cuRAND call while capturing
                raise CaptureUnsafe(
                    f"the step calls a CUDA library that CuPy cannot capture ({error}): "
                    "the products and Cholesky solves of refdml.gpu.linalg can be captured, "
                    "other library calls cannot; train this model and objective with "
                    "capture=False") from error
            raise
        executable = self.stream.end_capture()
        self.stage.capturing = False
        graph.captures += 1
        graph.launches = getattr(getattr(executable, "launches", None), "total", 0)
        if pool is not None:
            graph.keep.append(pool)
        if state is not None and not _same_state(state, objective.state_dict()):
            raise CaptureUnsafe("the objective drew from its generator inside the captured "
                                "step: a replay would not draw it (draw it in host_draws)")
        if check and _sizes(records) != graph.sizes:
            raise CaptureUnsafe(f"a replay recorded reads of sizes {_sizes(records)}, the "
                                f"capture {graph.sizes}: the step is not the same every time")
        return executable, records

    def _row(self, graph: _Graph, reads: DeferredReads,
             on_loss: Callable[[float], None]) -> None:
        """One deferred read of this step's ring row, labelled with the step (reads.where)."""
        if graph.rows >= graph.ring.shape[0]:
            raise RuntimeError("the ring of a captured step is full: the loop reads every "
                               "log_every steps")
        row = graph.ring[graph.rows]                # a view: no launch
        graph.rows += 1
        sizes, templates = graph.sizes, graph.templates

        def on_read(values: np.ndarray, where: str) -> None:
            on_loss(float(values[0]))
            start, first = 1, None
            for size, template in zip(sizes, templates):
                try:
                    template(values[start:start + size], where)
                except Exception as error:      # noqa: BLE001 - the first is re-raised
                    if first is None:
                        first = error
                start += size
            if first is not None:
                raise first

        reads.add(row, on_read)


def _same_state(a: Any, b: Any) -> bool:
    """Equality of two ``state_dict()`` results (nested dicts, lists, arrays, scalars)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return a == b
