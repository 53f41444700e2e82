"""Time per training step of the digits-collage and token models (a benchmark, not a test).

    python scripts/bench_train.py                    # both models, CPU, 15 repeats
    python scripts/bench_train.py --only collage     # one model (repeatable: --only tokens)
    python scripts/bench_train.py --device cuda      # CuPy on a GPU (where one is lent)
    python scripts/bench_train.py --quick            # 3 repeats, a smoke run

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

BLAS threads: OpenBLAS's worker threads spin while they wait, and on a machine whose cores
are busy with other work they make a matrix product many times slower, not faster; the
script therefore pins BLAS (OpenBLAS, MKL, OpenMP) to ``REFDML_BENCH_BLAS_THREADS`` threads
(default 1, as scripts/bench_gpu.py does) unless those variables are already set. Single-
thread numbers are also the fair basis of the issue's "2 CPU cores" goals.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, os.environ.get("REFDML_BENCH_BLAS_THREADS", "1"))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402

from _bench import interleaved  # noqa: E402  (scripts/ is on sys.path when run as a script)

from refdml.train.runs import build_run  # noqa: E402

PATHS = (("fast", "float32"), ("fast", "float64"), ("ref", "float64"))
STUDIES = {"collage": "digits-collage", "tokens": "tokens"}


class Step:
    """One model + objective + Adam on a fixed batch; ``__call__`` runs one training step."""

    def __init__(self, which: str, path: str, dtype: str, device: str) -> None:
        import tempfile

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

    def sync(self) -> None:
        if self.device == "cuda":
            self.xp.cuda.Device().synchronize()

    def __call__(self) -> None:
        self.optimizer.zero_grad()
        outputs, ctx = self.model.forward(self.x)
        _, octx = self.objective.forward(outputs, self.labels)
        self.model.backward(ctx, self.objective.backward(octx, 1.0))
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


def bench(which: str, device: str, repeats: int) -> None:
    steps = {f"{path} {dtype[-2:]}": Step(which, path, dtype, device) for path, dtype in PATHS}
    for step in steps.values():  # keep a row of the table from timing a broken step
        step()
    medians = interleaved(steps, repeats, warmups=2)
    print(f"\n== {which} model, batch {steps['fast 64'].labels.shape[0]}, device {device}, "
          f"median of {repeats} interleaved steps ==")
    ref = medians["ref 64"]
    print(f"{'path':<10}{'ms/step':>10}{'vs ref f64':>12}")
    for name, seconds in medians.items():
        print(f"{name:<10}{1e3 * seconds:>10.2f}{ref / seconds:>11.2f}x")
    shares = {name: layer_shares(step, repeats) for name, step in steps.items()}
    keys = list(next(iter(shares.values())))
    print(f"\nshare of step time per component ({', '.join(shares)})")
    print(f"{'component':<16}" + "".join(f"{name:>10}" for name in shares))
    for key in keys:
        print(f"{key:<16}" + "".join(f"{shares[name].get(key, 0.0):>10.1%}" for name in shares))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=("collage", "tokens"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="3 repeats: a smoke run")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    print(f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']} "
          f"(see the module docstring); numpy {np.__version__}")
    for which in args.only or ("collage", "tokens"):
        bench(which, args.device, repeats)


if __name__ == "__main__":
    main()
