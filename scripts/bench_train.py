"""Time per training step of the digits-collage and token models (a benchmark, not a test).

    python scripts/bench_train.py                    # both models, CPU, 15 repeats
    python scripts/bench_train.py --only collage     # one model (repeatable: --only tokens)
    python scripts/bench_train.py --device cuda      # CuPy on a GPU (where one is lent)
    python scripts/bench_train.py --quick            # 3 repeats, a smoke run
    python scripts/bench_train.py --json out.json    # the tables also as JSON (see below)
    python scripts/bench_train.py --torch-only       # only the rows against PyTorch
    python scripts/bench_train.py --torch-only --rounds 5   # more alternating processes
    python scripts/bench_train.py --thread-pools     # the step with each thread pool widened

A step is what :class:`refdml.train.Trainer` does per batch: ``zero_grad``, model forward,
objective forward and backward, model backward, Adam step. Per model, three paths:

- ``fast f32`` / ``fast f64``: the fast path (:mod:`refdml.gpu` operators in the heads and
  the objective; the layers' own pairs), in float32 / float64;
- ``ref f64``: ``reference=True`` (the float64 NumPy reference operators, what
  ``--reference`` runs). The reference is float64 only, so there is no ``ref f32``.

Step times are medians of ``--repeats`` steps, the paths interleaved in one process (a busy
machine slows them alike, so their ratio holds; the absolute times do not). The share of
time per layer comes from a second, separate pass in which every layer's ``forward`` and
``backward`` (and the objective's and the optimiser's calls) are wrapped by timers (on a
GPU each timer synchronises the device, which costs a little and is why this pass is
separate from the step timing); a share is the component's median time over the sum of
the components' medians (so the column adds up to 100%).

Models: exactly the training defaults, built by :func:`refdml.train.runs.build_run`
(``refdml train --study digits-collage`` / ``--study tokens`` with only ``dtype`` and
``reference`` changed), on the first batch of the run's own P x K sampler:

- ``collage``: the digits-collage model of docs/train.md at its defaults (batch 64 = 8
  classes x 8 collages), its objective (GSP Alg. 1 with the contrastive loss and the
  zero-shot regulariser) and Adam;
- ``tokens``: the GSP token study at its defaults (batch 64 = 16 classes x 4 samples of 50
  tokens), its objective and Adam; the token table's clip after the step is left out.

Against PyTorch (CPU only, where ``torch`` is installed; the rows are skipped otherwise):
the same model, objective, Adam, batch and initial parameters in PyTorch
(scripts/_torch_twin.py: PyTorch's own convolutions, linear layers and Adam under
autograd; the GSP head and the objective enter as custom autograd functions around the
refdml objects, so they cost the same on both sides), float32. Each side runs ALONE in a
process of its own, as a training run would: the two steps interleaved in one process
change each other's heap history (whether glibc hands freed memory back to the system, to
be faulted in again at the next step) and thread pools (OpenMP and OpenBLAS workers
spinning on each other's cores). The processes alternate, refdml then PyTorch,
``--rounds`` times, at 1 thread and at the machine's ``os.cpu_count()`` threads
(``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` set before either starts; refdml's side
thread, :func:`refdml.train.side_thread`, off at one thread and on at ``N``), and a row
``1/N`` compares each at its default: refdml at one BLAS thread with its side thread (what
:class:`refdml.train.Trainer` runs: ``blas_threads=1``, ``side_thread=True``; a process of
its own in each round) against PyTorch at all ``N``; a round gives
each side's median over ``--repeats`` steps, wall clock and CPU time (on a shared machine
the CPU time of a one-thread step is the steadier), and the table gives the median over
rounds of the times and of the per-round ratios. Before timing, one float64 step of both
is compared (every parameter to 1e-12 of its largest entry), so a twin that drifted from
the model fails instead of timing something else.

Three sides (:data:`SIDES`): ``refdml``, the ``torch`` twin above, and, for the digits-collage model, ``torch-full``: the whole model in
PyTorch (scripts/_torch_anchors.py's ``collage_twin``: the GSP layer as its authors
describe it, 100 fixed-point iterations of (P2) and the closed-form backward, and the
objective in torch; what a PyTorch user of the paper would train, and the anchor of the
GPU step in scripts/bench_gpu.py). A second table splits the refdml and twin steps into
the pieces they share (refdml's GSP head and objective, timed on each side in a pass of
its own) and their own layers: the ratio against the twin lies between the own layers'
ratio and 1 whatever the shared pieces cost (:func:`_split_table`). A third (digits-collage)
gives the bound the matrix products set: the step's products (:func:`model_products`: every
layer's forward and backward products, from the shapes the layers see) timed alone in
refdml's one-thread process (:func:`products_ms`), against the whole-PyTorch step of the
same rounds, and what a step at 0.6x of PyTorch would leave for everything else
(:func:`_products_table`).

BLAS threads: OpenBLAS's worker threads spin while they wait, and on a machine whose cores
are busy with other work they make a matrix product many times slower, not faster; the
script therefore pins BLAS (OpenBLAS, MKL, OpenMP) to ``REFDML_BENCH_BLAS_THREADS`` threads
(default 1, as scripts/bench_gpu.py does) unless those variables are already set. Single-
thread numbers are also the fair basis of the issue's "2 CPU cores" goals.

Thread pools (``--thread-pools``, CPU, this process): the refdml ``fast f32`` step with each
thread pool threadpoolctl finds (NumPy's and SciPy's OpenBLAS, each its own copy; OpenMP)
and Numba's threading layer widened to ``os.cpu_count()`` threads in turn (the others at
one), every copy of one library together, none and all, alternating ``--rounds`` times
(:func:`bench_thread_pools`): which pools a second thread helps and which slow the step
(docs/train.md, "Against PyTorch").

``--json PATH`` writes the printed tables as a document of schema ``refdml-bench/1``
(scripts/_bench.py: ``schema``, ``script``, ``command``, ``date``, ``machine``,
``git_commit``, ``tables``, ``notes``) and, beside them, the unrounded results under the
keys this option wrote before (``numpy``, ``cpu_count``, ``load_average``, ``repeats``,
``device``, ``models``, ``load_average_after``).
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, os.environ.get("REFDML_BENCH_BLAS_THREADS", "1"))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, clocked, interleaved, write_json  # noqa: E402

from refdml.train import side_thread as side_thread_of_refdml  # noqa: E402
from refdml.train.layers import (Conv2d, GSPHead, L2Normalize, Linear, LocalLinear,  # noqa: E402
                                 ReLU)
from refdml.train.runs import build_run  # noqa: E402

PATHS = (("fast", "float32"), ("fast", "float64"), ("ref", "float64"))
STUDIES = {"collage": "digits-collage", "tokens": "tokens"}


class Step:
    """One model + objective + Adam on a fixed batch; ``__call__`` runs one training step."""

    def __init__(self, which: str, path: str, dtype: str, device: str) -> None:
        config = dict(dtype=dtype, device=device, reference=path == "ref", epochs=0,
                      progress=False)
        self.run = build_run(STUDIES[which], config, out_dir=tempfile.mkdtemp())
        trainer = self.run.trainer
        batch = next(iter(trainer.train_sampler))
        self.x, self.labels = trainer._to_device(trainer.train_x[batch], trainer.train_y[batch])
        self.model, self.objective = self.run.model, self.run.objective
        self.optimizer = trainer.optimizer
        self.xp = trainer._xp
        self.device = device
        self._model_ctx = self._objective_ctx = None

    def sync(self) -> None:
        if self.device == "cuda":
            self.xp.cuda.Device().synchronize()

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        # Each context lives until the next step's forward has returned, as the Trainer's
        # loop variables do. Dropped at the end of each step instead, they would free the
        # whole step's memory at once; glibc then returns it to the system and the next
        # step faults it back in (thousands of page faults per digits-collage step, which
        # a training run does not pay).
        outputs, self._model_ctx = self.model.forward(self.x)
        _, self._objective_ctx = self.objective.forward(outputs, self.labels)
        self.model.backward(self._model_ctx,
                            self.objective.backward(self._objective_ctx, 1.0))
        self.optimizer.step()
        self.sync()



def _wrap(obj, method: str, key: str, record: dict, sync) -> None:
    inner = getattr(obj, method)

    def timed(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sync()
        record[key] += time.perf_counter() - start
        return out

    setattr(obj, method, timed)  # instance attribute: shadows the class method


def layer_shares(step: Step, repeats: int) -> dict:
    """Share of each component: its median time over the sum of the components' medians."""
    record: dict = defaultdict(float)
    for layer in step.model.layers:
        _wrap(layer, "forward", f"{layer.name} fwd", record, step.sync)
        _wrap(layer, "backward", f"{layer.name} bwd", record, step.sync)
    _wrap(step.objective, "forward", "objective fwd", record, step.sync)
    _wrap(step.objective, "backward", "objective bwd", record, step.sync)
    _wrap(step.optimizer, "step", "adam step", record, step.sync)
    step()
    times = defaultdict(list)
    for _ in range(repeats):
        record.clear()
        step()
        for key, value in record.items():
            times[key].append(value)
    medians = {key: statistics.median(values) for key, values in times.items()}
    total = sum(medians.values())
    return {key: value / total for key, value in medians.items()}


def _torch_twin_of(which: str, dtype: str):
    """The PyTorch twin of a freshly built fast-path ``Step`` (see the module docstring)."""
    from _torch_twin import torch_twin  # imports torch

    step = Step(which, "fast", dtype, "cpu")
    return step, torch_twin(step.model, step.objective, step.optimizer, step.x, step.labels)


def check_torch_twin(which: str) -> float:
    """One float64 step of refdml and of its PyTorch twin from the same start: the largest
    difference of a parameter after the step, relative to its largest entry. Raises when
    it exceeds 1e-12 (the two compute the same maths; only rounding differs)."""
    ours = Step(which, "fast", "float64", "cpu")
    _, twin = _torch_twin_of(which, "float64")
    ours()
    twin.step()
    worst = 0.0
    for param in ours.optimizer.params:
        theirs = twin.named_parameters[param.name].detach().numpy()
        worst = max(worst, float(np.abs(param.value - theirs).max() / np.abs(param.value).max()))
    if not worst <= 1e-12:
        raise AssertionError(f"{which}: the PyTorch twin differs from refdml by {worst:.3g} "
                             "after one float64 step; it is not the same model")
    return worst


#: The sides of the PyTorch rows: refdml's fast path, its PyTorch twin (refdml's GSP head
#: and objective inside autograd: the pieces both sides share) and, for the digits-collage
#: model, the whole model in PyTorch (the GSP layer as its authors describe it).
SIDES = ("refdml", "torch", "torch-full")


def _shared_ms(model, objective, run_step, repeats: int) -> float:
    """Median milliseconds per step spent in the pieces the PyTorch twin takes from refdml
    (the GSP heads' and the objective's forward and backward), over ``repeats`` steps of
    ``run_step``; the timers wrap the refdml objects, so they time the same calls on both
    sides. A pass of its own, after the timed one: the step timing carries no timer."""
    record: dict = defaultdict(float)
    for layer in model.layers:
        if isinstance(layer, GSPHead):
            _wrap(layer, "forward", "shared", record, lambda: None)
            _wrap(layer, "backward", "shared", record, lambda: None)
    _wrap(objective, "forward", "shared", record, lambda: None)
    _wrap(objective, "backward", "shared", record, lambda: None)
    times = []
    for _ in range(repeats):
        record.clear()
        run_step()
        times.append(record["shared"])
    return 1e3 * statistics.median(times)


def _time_alone(side: str, which: str, repeats: int, side_thread: bool = False) -> dict:
    """Median wall and CPU (process) milliseconds of ``repeats`` float32 steps of one side
    (:data:`SIDES`), after two untimed steps; and, except for ``torch-full`` (which shares
    nothing), ``shared``: the median milliseconds per step in the shared pieces
    (:func:`_shared_ms`). ``side_thread``: refdml's steps run inside
    :func:`refdml.train.side_thread`, as :meth:`refdml.train.Trainer.fit` runs them where
    the process has two CPUs or more."""
    if side == "refdml":
        step = Step(which, "fast", "float32", "cpu")
        model, objective = step.model, step.objective
        if side_thread:
            step = _inside(side_thread_of_refdml, step)
    else:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if side == "torch":
            ours, twin = _torch_twin_of(which, "float32")
        else:
            ours, twin = _full_torch_of(which)
        model, objective, step = ours.model, ours.objective, twin.step
    for _ in range(2):
        step()
    wall, cpu = [], []
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    times = {"wall": 1e3 * statistics.median(wall), "cpu": 1e3 * statistics.median(cpu)}
    if side != "torch-full":
        times["shared"] = _shared_ms(model, objective, step, repeats)
    if side == "refdml" and not side_thread:      # step is the Step itself here
        products = model_products(step)
        times["products"] = products_ms(products, np.float32, repeats)
        times["products_gflop"] = 2e-9 * sum(m * k * n for m, k, n in products)
    return times


#: Layers with no matrix product (:func:`model_products`).
_NO_PRODUCTS = (ReLU, L2Normalize)


def model_products(step: Step) -> list[tuple[int, int, int]]:
    """The matrix products of one step of ``step``'s model, as ``(M, K, N)``: an (M, K) by
    (K, N) product each (forward and backward), from the shapes its layers see on the
    step's batch. Convolutions count their im2col product and its two backward products
    (none for the input of a layer with ``input_grad=False``); ``LocalLinear`` and
    ``Linear`` likewise; the GSP head its cost map and the two products of the cost map's
    backward (the pooled feature's and ``z``'s matrix-vector products, and the objective's
    B x B products, are left out: under 1% of the step's FLOPs here). A layer of another
    kind is a ``TypeError``, so that the bound never silently omits one."""
    products = []
    x = step.x
    for layer in step.model.layers:
        out, ctx = layer.forward(x)
        if isinstance(layer, Conv2d):
            (rows, inner), n_out = ctx.cols.shape, ctx.weight.shape[0]
            products += [(rows, inner, n_out), (n_out, rows, inner)]
            if layer.input_grad:
                products.append((rows, n_out, inner))
        elif isinstance(layer, (LocalLinear, Linear)):
            n_out, n_in = layer.weight.value.shape
            rows = int(np.prod(x.shape)) // n_in
            products += [(rows, n_in, n_out), (n_out, rows, n_in), (rows, n_out, n_in)]
        elif isinstance(layer, GSPHead):
            batch, n, d = x.shape
            m = layer.prototypes.value.shape[0]
            products += [(batch * n, d, m), (batch * n, m, d), (m, batch * n, d)]
        elif not isinstance(layer, _NO_PRODUCTS):
            raise TypeError(f"model_products: no product count for {type(layer).__name__}")
        x = out[0] if layer.n_outputs == 2 else out
    return products


def products_ms(products, dtype, repeats: int) -> float:
    """The sum over ``products`` of each one's median milliseconds, timed alone ``repeats``
    times after one untimed run with fresh contiguous operands of its shape (NumPy's
    ``matmul``: this process's BLAS at its thread count). Each product's operands stay in
    the cache over its repeats, so this is a lower bound of what the step's products cost
    (run back to back on operands fresh from memory they take longer)."""
    rng = np.random.default_rng(0)
    total = 0.0
    for m, k, n in products:
        a = rng.standard_normal((m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        out = np.empty((m, n), dtype=dtype)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            np.matmul(a, b, out=out)
            times.append(time.perf_counter() - start)
        total += statistics.median(times[1:])
    return 1e3 * total


def _inside(context, function):
    """``function`` run inside a fresh ``context()`` at every call."""
    def run():
        with context():
            return function()
    return run


def _full_torch_of(which: str):
    """The digits-collage model wholly in PyTorch (scripts/_torch_anchors.py's
    ``collage_twin``: the GSP layer with the authors' fixed-point (P2) and closed-form
    backward, the objective in torch), from a freshly built fast-path ``Step``'s values."""
    import _torch_anchors

    if which != "collage":
        raise ValueError(f"no whole-PyTorch model of {which!r}: the digits-collage model only")
    step = Step(which, "fast", "float32", "cpu")
    return step, _torch_anchors.collage_twin(step.model, step.objective, step.optimizer,
                                             step.x, step.labels)


def _run_alone(side: str, which: str, threads: int, repeats: int,
               side_thread: bool = False) -> dict:
    """:func:`_time_alone` in a child process with ``threads`` BLAS/OpenMP threads."""
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        env[var] = str(threads)
    command = [sys.executable, os.path.abspath(__file__), "--time-alone", side, which,
               "--repeats", str(repeats)] + (["--side-thread"] if side_thread else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"timing {side} {which} at {threads} threads failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_torch(which: str, repeats: int, rounds: int, tables: list) -> dict | None:
    """refdml ``fast f32`` against its PyTorch twin and (digits-collage) against the model
    wholly in PyTorch, each alone in its own process, alternating, at 1 and at
    ``os.cpu_count()`` threads; then where the twin's ratio can go (:func:`_split_table`).
    None (and a note) without torch."""
    try:
        import torch
    except ImportError:
        print(f"\n(PyTorch is not installed: no PyTorch rows for {which})")
        return None
    agreement = check_torch_twin(which)
    sides = SIDES if which == "collage" else SIDES[:2]
    table = {}
    most = str(max(1, os.cpu_count() or 1))
    default_runs = []
    for threads in sorted({1, os.cpu_count() or 1}):
        runs = {side: [] for side in sides}
        for _ in range(rounds):
            for side in sides:
                # refdml's side thread is a second core: on at N threads, off at one.
                runs[side].append(_run_alone(side, which, threads, repeats,
                                             side_thread=side == "refdml" and threads > 1))
            if threads > 1:
                # refdml at its default (Trainer: one BLAS thread, the side thread on).
                default_runs.append(_run_alone("refdml", which, 1, repeats, side_thread=True))
        table[str(threads)] = {
            clock: {f"{side}_ms": statistics.median(r[clock] for r in runs[side])
                    for side in sides}
            | {f"ratio_{side}": statistics.median(a[clock] / b[clock] for a, b in
                                                  zip(runs["refdml"], runs[side]))
               for side in sides[1:]}
            for clock in ("wall", "cpu")}
        table[str(threads)]["shared"] = {
            side: statistics.median(r["shared"] for r in runs[side]) for side in sides[:2]}
        if all("products" in r for r in runs["refdml"]):
            table[str(threads)]["products"] = {
                key: statistics.median(r[key] for r in runs["refdml"])
                for key in ("products", "products_gflop")}
        if threads > 1:
            # Each at its own default: refdml.train pins BLAS to one thread (Trainer's
            # blas_threads=1) and runs its side thread, PyTorch uses every core. Per-round
            # ratios, as in the other rows (the processes of one round ran side by side).
            table[f"1/{most}"] = {
                clock: {"refdml_ms": statistics.median(r[clock] for r in default_runs)}
                | {f"{side}_ms": table[most][clock][f"{side}_ms"] for side in sides[1:]}
                | {f"ratio_{side}": statistics.median(a[clock] / b[clock] for a, b in
                                                      zip(default_runs, runs[side]))
                   for side in sides[1:]}
                for clock in ("wall", "cpu")}
    title = (f"{which}: refdml fast f32 vs PyTorch {torch.__version__} f32 (same model, "
             f"batch, initial parameters; float64 twin check {agreement:.1e}); each alone in "
             f"its own process, {rounds} alternating rounds of {repeats} steps")
    print(f"\n== {title} ==")
    columns = ["threads", "clock", "refdml ms", "twin ms", "refdml/twin"]
    if "torch-full" in sides:
        columns += ["PyTorch-only ms", "refdml/PyTorch-only"]
    printed = Table(f"Time per training step, {title}; medians over the rounds, ratios "
                    "refdml / PyTorch (twin: refdml's GSP head and objective inside autograd; "
                    "PyTorch-only: the whole model in PyTorch, the GSP layer as its authors "
                    "describe it)", columns)
    tables.append(printed)
    widths = [9, 6, 11, 10, 13, 17, 21]
    print("".join(f"{c:>{w}}" if i > 1 else f"{c:<{w}}" for i, (c, w) in
                  enumerate(zip(columns, widths))))
    for threads, clocks in table.items():
        for clock in ("wall", "cpu"):
            row = clocks[clock]
            cells = [threads, clock, f"{row['refdml_ms']:.2f}", f"{row['torch_ms']:.2f}",
                     f"{row['ratio_torch']:.2f}x"]
            if "torch-full" in sides:
                cells += [f"{row['torch-full_ms']:.2f}", f"{row['ratio_torch-full']:.2f}x"]
            c = printed.add(*cells)
            print("".join(f"{cell:>{w}}" if i > 1 else f"{cell:<{w}}" for i, (cell, w) in
                          enumerate(zip(c, widths))))
    tables.append(_split_table(which, table))
    if "torch-full" in sides:
        tables.append(_products_table(which, table))
    return {"torch_version": torch.__version__, "float64_agreement": agreement,
            "rounds": rounds, "threads": table}


def _split_table(which: str, table: dict) -> Table:
    r"""Where the ratio against the twin can go: each side's step split into the pieces the
    two share (``S``: refdml's GSP head and objective, timed on each side) and its own
    (``C``: convolutions, dense layers, Adam, the per-layer overhead), wall clock.

    With ``R = S + C_r`` and ``T = S + C_t``, ``R / T`` lies between ``C_r / C_t`` and 1
    whatever ``S`` is (a mediant), so speeding up the shared pieces moves it towards
    ``C_r / C_t``, never past it; and ``R / T <= q`` needs ``C_r <= q T - S``: the column
    "own ms for 0.6x" (negative: no speed of refdml's own layers reaches 0.6x while the
    shared pieces cost what they do).
    """
    columns = ["threads", "shared ms (refdml / twin)", "own ms refdml", "own ms twin",
               "own refdml/twin", "own ms for 0.6x"]
    split = Table(f"{which}: the step split into the shared pieces (refdml's GSP head and "
                  "objective, on both sides) and each side's own layers, wall clock; "
                  "R / T lies between own refdml/twin and 1 (scripts/bench_train.py, "
                  "_split_table)", columns)
    print(f"\n{which}: shared pieces and own layers (wall; see _split_table)")
    print("  ".join(columns))
    for threads, clocks in table.items():
        if "shared" not in clocks:      # the defaults row (bench_torch)
            continue
        shared = clocks["shared"]
        wall = clocks["wall"]
        own_refdml = wall["refdml_ms"] - shared["refdml"]
        own_torch = wall["torch_ms"] - shared["torch"]
        c = split.add(threads, f"{shared['refdml']:.2f} / {shared['torch']:.2f}",
                      f"{own_refdml:.2f}", f"{own_torch:.2f}",
                      f"{own_refdml / own_torch:.2f}x",
                      f"{0.6 * wall['torch_ms'] - shared['refdml']:.2f}")
        print("  ".join(str(cell) for cell in c))
    return split


def _products_table(which: str, table: dict) -> Table:
    """The bound the matrix products set (:func:`model_products`, :func:`products_ms`): the
    step's products alone, at refdml's one-thread rows, against the whole-PyTorch step of
    the same rounds; "left for the rest at 0.6x" is what a step at 0.6x of PyTorch would
    leave for everything that is not a product (negative: no speed of the rest reaches
    it while OpenBLAS runs the products at this rate)."""
    columns = ["threads", "refdml ms", "products ms", "GFLOP", "GFLOP/s",
               "products/PyTorch-only", "rest ms refdml", "rest ms left at 0.6x"]
    bound = Table(f"{which}: the step's matrix products alone (the same shapes, fresh "
                  "operands, NumPy's OpenBLAS in refdml's process), against the whole-PyTorch "
                  "step; wall clock, medians over the rounds (scripts/bench_train.py, "
                  "_products_table)", columns)
    print(f"\n{which}: the products' bound (wall; see _products_table)")
    print("  ".join(columns))
    for threads, clocks in table.items():
        if "products" not in clocks:
            continue
        wall, products = clocks["wall"], clocks["products"]
        ms, gflop = products["products"], products["products_gflop"]
        c = bound.add(threads, f"{wall['refdml_ms']:.2f}", f"{ms:.2f}", f"{gflop:.3f}",
                      f"{gflop / ms * 1e3:.0f}", f"{ms / wall['torch-full_ms']:.2f}x",
                      f"{wall['refdml_ms'] - ms:.2f}",
                      f"{0.6 * wall['torch-full_ms'] - ms:.2f}")
        print("  ".join(str(cell) for cell in c))
    return bound


def bench(which: str, device: str, repeats: int, tables: list) -> dict:
    steps = {f"{path} {dtype[-2:]}": Step(which, path, dtype, device) for path, dtype in PATHS}
    for step in steps.values():  # keep a row of the table from timing a broken step
        step()
    medians = interleaved(steps, repeats, warmups=2)
    setting = (f"{which} model, batch {steps['fast 64'].labels.shape[0]}, device {device}, "
               f"BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"\n== {which} model, batch {steps['fast 64'].labels.shape[0]}, device {device}, "
          f"median of {repeats} interleaved steps ==")
    table = Table(f"Time per training step (zero_grad, forward, objective, backward, Adam), "
                  f"{setting}, median of {repeats} interleaved steps; vs ref f64 = the float64 "
                  "reference's time / the path's", ["path", "ms/step", "vs ref f64"])
    tables.append(table)
    ref = medians["ref 64"]
    print(f"{'path':<10}{'ms/step':>10}{'vs ref f64':>12}")
    for name, seconds in medians.items():
        c = table.add(name, f"{1e3 * seconds:.2f}", f"{ref / seconds:.2f}x")
        print(f"{c[0]:<10}{c[1]:>10}{c[2]:>12}")
    shares = {name: layer_shares(step, repeats) for name, step in steps.items()}
    keys = list(next(iter(shares.values())))
    print(f"\nshare of step time per component ({', '.join(shares)})")
    table = Table(f"Share of step time per component, {setting} (a separate pass with every "
                  "component timed; a share is the component's median over the sum of the "
                  f"medians, {repeats} steps)", ["component", *shares])
    tables.append(table)
    print(f"{'component':<16}" + "".join(f"{name:>10}" for name in shares))
    for key in keys:
        c = table.add(key, *(f"{shares[name].get(key, 0.0):.1%}" for name in shares))
        print(f"{c[0]:<16}" + "".join(f"{cell:>10}" for cell in c[1:]))
    return {"ms_per_step": {name: 1e3 * seconds for name, seconds in medians.items()},
            "shares": shares}


def _thread_pools() -> list:
    """``(label, get, set)`` of every thread pool a CPU step can use: each BLAS and OpenMP
    library threadpoolctl finds loaded (NumPy and SciPy ship one OpenBLAS each; the label
    names the package folder it came from), and Numba's threading layer where Numba is
    loaded (the fused optimiser's CPU twin is a parallel kernel)."""
    from threadpoolctl import ThreadpoolController

    pools = []
    for lib in ThreadpoolController().lib_controllers:
        folder = os.path.basename(os.path.dirname(lib.filepath))
        pools.append((f"{lib.internal_api} ({folder})", lambda lib=lib: lib.num_threads,
                      lambda n, lib=lib: lib.set_num_threads(n)))
    if "numba" in sys.modules:
        import numba

        pools.append(("numba", numba.get_num_threads, numba.set_num_threads))
    return pools


def bench_thread_pools(which: str, repeats: int, rounds: int, tables: list) -> dict:
    """The refdml ``fast f32`` step in this process with each thread pool alone at
    ``os.cpu_count()`` threads (the others at 1), every copy of one library (two
    OpenBLAS), none, and all: where more threads help the step and where pools' idle
    workers, spinning beside it, hurt. The settings
    alternate, ``rounds`` times, each timed over ``repeats`` steps after two untimed ones
    (so that a pool's workers have started); medians over rounds."""
    wide = os.cpu_count() or 1
    if wide < 2:
        print(f"\n(one CPU: no thread pool of the {which} step to widen)")
        return {}
    step = Step(which, "fast", "float32", "cpu")
    step()                                   # loads every library the step calls
    pools = _thread_pools()
    settings = {"all at 1": {}}
    settings.update({f"{label} at {wide}": {label: wide} for label, _, _ in pools})
    for api in sorted({label.split(" ")[0] for label, _, _ in pools}):
        copies = [label for label, _, _ in pools if label.split(" ")[0] == api]
        if len(copies) > 1:          # NumPy's and SciPy's OpenBLAS: each copy its own workers
            settings[f"every {api} at {wide}"] = dict.fromkeys(copies, wide)
    settings[f"all at {wide}"] = {label: wide for label, _, _ in pools}
    before = {label: get() for label, get, _ in pools}
    times: dict = {name: [] for name in settings}
    try:
        for _ in range(rounds):
            for name, wanted in settings.items():
                for label, _, set_threads in pools:
                    set_threads(wanted.get(label, 1))
                for _ in range(2):
                    step()
                times[name].append(statistics.median(
                    clocked(step)[0] for _ in range(repeats)))
    finally:
        for label, _, set_threads in pools:
            set_threads(before[label])
    base = statistics.median(times["all at 1"])
    table = Table(f"{which}: the refdml fast f32 step with one thread pool at a time widened "
                  f"to {wide} threads (the others at 1), in one process, {rounds} alternating "
                  f"rounds of {repeats} steps (medians); vs all at 1 = that time / the row's",
                  ["thread pools", "ms/step", "vs all at 1"])
    tables.append(table)
    print(f"\n== {which}: thread pools of the refdml step, {rounds} rounds of {repeats} steps ==")
    print(f"{'thread pools':<44}{'ms/step':>10}{'vs all at 1':>13}")
    out = {}
    for name, values in times.items():
        median = statistics.median(values)
        out[name] = 1e3 * median
        c = table.add(name, f"{1e3 * median:.2f}", f"{base / median:.2f}x")
        print(f"{c[0]:<44}{c[1]:>10}{c[2]:>13}")
    return out


def _device_name(device: str) -> str:
    if device != "cuda":
        return device
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:                       # the name is a label: never stop the run for it
        return "cuda"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=("collage", "tokens"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats: a smoke run")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables (schema refdml-bench/1) and the results "
                             "to PATH")
    parser.add_argument("--torch-only", action="store_true",
                        help="only the comparison with PyTorch (no paths table, no shares)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds (3): refdml/PyTorch processes per thread "
                             "count, or --thread-pools' settings")
    parser.add_argument("--thread-pools", action="store_true",
                        help="only the step with each BLAS / OpenMP / Numba thread pool "
                             "widened in turn (CPU)")
    parser.add_argument("--time-alone", nargs=2, metavar=("SIDE", "MODEL"),
                        help=argparse.SUPPRESS)   # the child process of the PyTorch rows
    parser.add_argument("--side-thread", action="store_true",
                        help=argparse.SUPPRESS)   # its refdml side inside side_thread
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    if args.time_alone:
        print(json.dumps(_time_alone(*args.time_alone, repeats, args.side_thread)))
        return
    load = list(os.getloadavg())   # a busy machine slows every row (module docstring)
    notes = [f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} "
             f"(see the module docstring); numpy {np.__version__}; "
             "load average " + " ".join(f"{x:.2f}" for x in load)]
    print(notes[-1])
    results = {"numpy": np.__version__, "cpu_count": os.cpu_count(), "load_average": load,
               "repeats": repeats, "device": args.device, "models": {}}
    tables: list = []
    if args.thread_pools and args.device != "cpu":
        parser.error("--thread-pools times the CPU step (--device cpu)")
    for which in args.only or ("collage", "tokens"):
        if args.thread_pools:
            results["models"][which] = {
                "thread_pools": bench_thread_pools(which, repeats, args.rounds, tables)}
            continue
        entry = {} if args.torch_only else bench(which, args.device, repeats, tables)
        if args.device == "cpu":
            entry["torch"] = bench_torch(which, repeats, args.rounds, tables)
            if entry["torch"] is None:
                notes.append(f"PyTorch is not installed: no PyTorch rows for {which}")
        results["models"][which] = entry
    results["load_average_after"] = list(os.getloadavg())
    notes.append("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("\n" + notes[-1])
    if args.json:
        write_json(args.json, script=__file__, argv=argv, tables=tables, notes=notes,
                   device=_device_name(args.device), extra=results)


if __name__ == "__main__":
    main()
