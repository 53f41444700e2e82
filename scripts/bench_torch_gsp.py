r"""refdml.torch.GSPPool against the authors' GSP layer in PyTorch: values, stability, speed.

    python scripts/bench_torch_gsp.py                  # the three tables, CPU
    python scripts/bench_torch_gsp.py --quick          # small sizes, 2 repeats: a smoke run
    python scripts/bench_torch_gsp.py --device cuda    # CUDA tensors (refdml.torch on CuPy)
    python scripts/bench_torch_gsp.py --json out.json  # the tables also as JSON

Three GSP pooling layers (GSP Alg. 2, p = 1) on the same tensors, in one process:

- ``GSPPool``: :class:`refdml.torch.GSPPool`, refdml's fast path (its (P2) solve and its
  hand-derived backward) as a PyTorch custom op;
- ``authors closed form``: the layer as its authors describe it
  (scripts/_torch_anchors.py ``gsp_pool``): 100 fixed-point iterations of GSP Prop. 4.2
  with plain ``exp``, in a custom ``torch.autograd.Function`` whose backward is the closed
  form of Prop. 4.3 on the last iterate;
- ``authors unrolled``: the same iterations differentiated by autograd through all 100 of
  them (``backward="unrolled"``), as the authors' PyTorch layer does.

Tables:

1. **Values**: pooled, z and the gradients of features and prototypes (of
   ``<pooled, g> + <z, h>`` for random ``g``, ``h``) against refdml's float64 reference
   (:func:`refdml.gsp.gsp_pool_forward` / ``gsp_pool_backward``, NumPy), on ordinary inputs
   (unit-scale features and prototypes, mu = 0.3, inverse_temperature = 5), in float64 and
   float32. An error is ``max |got - want| / max |want|`` per array; the cell is the largest.
2. **Stability at extremes** (float64): mu = 1 - 1e-12 and mu = 1, inverse_temperature
   1e3 and 1e300, features scaled by 1e-200 and by 1e200, a prototype equal to a feature
   (a zero cost). A cell says whether every output and gradient is finite and, where the
   reference is, the error against it; an exception is named.
3. **Speed**: one PyTorch step (forward, backward of ``<pooled, g> + <z, h>``) at B = 64
   and 256, n = 49 (7 x 7), d = 128, m = 64, float32 and float64, at 1 thread and at the
   default (``torch.set_num_threads``; refdml's Numba and BLAS threads set alike), the
   three layers interleaved, the median of ``--repeats``. On ``--device cuda`` each call
   ends in ``torch.cuda.synchronize()`` and the threads column is the device's.

On a GPU ``GSPPool`` runs refdml's CuPy path on torch's current stream; without CuPy (or
without a CUDA device for torch) the run says so in one line and exits 0 with no table.
Without torch likewise. ``--json PATH`` writes the tables as scripts/_bench.py's
``refdml-bench/1`` document.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, interleaved, timed_rounds, write_json  # noqa: E402

from refdml import gsp as reference_gsp  # noqa: E402

M, N, D = 64, 49, 128
MU, INVERSE_TEMPERATURE = 0.3, 5.0
LAYERS = ("GSPPool", "authors closed form", "authors unrolled")
#: (name, dtype, mu, inverse_temperature, feature scale, a prototype on a feature)
EXTREMES = (
    ("mu = 1 - 1e-12", "float64", 1.0 - 1e-12, INVERSE_TEMPERATURE, 1.0, False),
    ("mu = 1", "float64", 1.0, INVERSE_TEMPERATURE, 1.0, False),
    ("inverse_temperature = 1e3", "float64", MU, 1e3, 1.0, False),
    ("inverse_temperature = 1e300", "float64", MU, 1e300, 1.0, False),
    ("features x 1e-200", "float64", MU, INVERSE_TEMPERATURE, 1e-200, False),
    ("features x 1e200", "float64", MU, INVERSE_TEMPERATURE, 1e200, False),
    ("a prototype on a feature", "float64", MU, INVERSE_TEMPERATURE, 1.0, True),
)


def inputs(batch: int, m: int, n: int, d: int, *, scale: float = 1.0, on_feature: bool = False,
           seed: int = 0):
    """Features ``(B, n, d)`` of norms in [0.5, 1.5] times ``scale``, prototypes ``(m, d)``
    of norms in [0.5, 1.5], and the upstream gradients ``g (B, d)``, ``h (B, m)``; float64.
    ``on_feature``: prototype 0 is feature (0, 0) (a zero cost, where the distance has no
    derivative and refdml takes the zero subgradient)."""
    rng = np.random.default_rng(seed)

    def rows(shape):
        x = rng.standard_normal(shape)
        norms = rng.uniform(0.5, 1.5, shape[:-1] + (1,))
        return x / np.linalg.norm(x, axis=-1, keepdims=True) * norms

    features, prototypes = rows((batch, n, d)) * scale, rows((m, d))
    if on_feature:
        prototypes[0] = features[0, 0]
    return features, prototypes, rng.standard_normal((batch, d)), rng.standard_normal((batch, m))


def reference(features, prototypes, g, h, mu, inverse_temperature):
    """refdml's float64 NumPy reference: (pooled, z, d_features, d_prototypes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (pooled, z), ctx = reference_gsp.gsp_pool_forward(
            features, prototypes, mu=mu, inverse_temperature=inverse_temperature)
        grads = reference_gsp.gsp_pool_backward(ctx, g, h)
    return pooled, z, grads.features, grads.prototypes


class Layers:
    """The three layers on ``device``: ``step(name, f, w, g, h, mu, eps)`` runs one forward
    and backward and returns ``(pooled, z, d_features, d_prototypes)`` as tensors."""

    def __init__(self, torch, device) -> None:
        import _torch_anchors as anchors
        import refdml.torch as refdml_torch

        self.torch, self.device = torch, device
        self._anchors, self._refdml = anchors, refdml_torch
        self._pools: dict = {}

    def _gsp_pool(self, w, mu, eps):
        key = (tuple(w.shape), w.dtype, mu, eps)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = self._refdml.GSPPool(
                w.shape[0], w.shape[1], mu=mu, inverse_temperature=eps, prototypes=w).to(w.device)
        return pool

    def step(self, name, f, w, g, h, mu, eps):
        torch = self.torch
        if name == "GSPPool":
            pool = self._gsp_pool(w, mu, eps)
            with torch.no_grad():
                pool.prototypes.copy_(w)
            pool.prototypes.grad = None
            features = f.detach().requires_grad_(True)
            pooled, z = pool(features)
            prototypes = pool.prototypes
        else:
            features = f.detach().requires_grad_(True)
            prototypes = w.detach().requires_grad_(True)
            backward = "closed_form" if name == "authors closed form" else "unrolled"
            pooled, z = self._anchors.gsp_pool(features, prototypes, mu=mu,
                                               inverse_temperature=eps, backward=backward)
        ((pooled * g).sum() + (z * h).sum()).backward()
        return pooled.detach(), z.detach(), features.grad, prototypes.grad


def relative_error(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    scale = float(np.max(np.abs(want)))
    diff = float(np.max(np.abs(got - want)))
    return diff / scale if scale > 0 else diff


def _host(tensor):
    return tensor.detach().cpu().double().numpy()


def _tensors(torch, device, dtype, *arrays):
    return [torch.as_tensor(np.asarray(a), dtype=dtype, device=device) for a in arrays]


def values_table(layers: Layers, batch: int, tables: list) -> None:
    torch = layers.torch
    host = inputs(batch, M, N, D)
    want = reference(*host, MU, INVERSE_TEMPERATURE)
    table = Table(
        f"Values: pooled, z, d_features, d_prototypes against refdml's float64 reference "
        f"(largest error relative to each array's largest entry), B={batch} m={M} n={N} "
        f"d={D} mu={MU} inverse_temperature={INVERSE_TEMPERATURE}, on {layers.device}",
        ["layer", "dtype", "pooled", "z", "d_features", "d_prototypes"])
    tables.append(table)
    for dtype in (torch.float64, torch.float32):
        f, w, g, h = _tensors(torch, layers.device, dtype, *host)
        for name in LAYERS:
            got = layers.step(name, f, w, g, h, MU, INVERSE_TEMPERATURE)
            table.add(name, str(dtype).replace("torch.", ""),
                      *(f"{relative_error(_host(a), b):.1e}" for a, b in zip(got, want)))


def stability_table(layers: Layers, batch: int, tables: list) -> None:
    torch = layers.torch
    table = Table(
        f"Stability at extremes (float64, B={batch} m={M} n={N} d={D}; otherwise mu={MU}, "
        f"inverse_temperature={INVERSE_TEMPERATURE}): 'finite' when every output and "
        "gradient is, then the largest error against refdml's float64 reference (each "
        "array's largest difference relative to its largest entry)",
        ["case", "reference", *LAYERS])
    tables.append(table)
    for case, dtype, mu, eps, scale, on_feature in EXTREMES:
        host = inputs(batch, M, N, D, scale=scale, on_feature=on_feature)
        try:
            want = reference(*host, mu, eps)
            finite_ref = all(np.all(np.isfinite(a)) for a in want)
            ref_cell = "finite" if finite_ref else "NOT finite"
        except Exception as exc:          # a refusal is a result here: name it
            want, finite_ref, ref_cell = None, False, f"error: {type(exc).__name__}"
        cells = []
        f, w, g, h = _tensors(torch, layers.device, getattr(torch, dtype), *host)
        for name in LAYERS:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = [_host(a) for a in layers.step(name, f, w, g, h, mu, eps)]
            except Exception as exc:
                cells.append(f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
                continue
            bad = [label for label, a in zip(("pooled", "z", "d_features", "d_prototypes"), got)
                   if not np.all(np.isfinite(a))]
            if bad:
                cells.append("NaN/inf in " + ", ".join(bad))
            elif finite_ref:
                errors = {label: relative_error(a, b) for label, a, b
                          in zip(("pooled", "z", "d_features", "d_prototypes"), got, want)}
                worst = max(errors, key=errors.get)
                cells.append(f"finite, {errors[worst]:.1e} ({worst})")
            else:
                cells.append("finite")
        table.add(case, ref_cell, *cells)


@contextlib.contextmanager
def threads(torch, count: int):
    """torch's intra-op threads, Numba's (refdml's CPU kernels) and BLAS's at ``count``."""
    import numba
    from threadpoolctl import threadpool_limits

    before_torch, before_numba = torch.get_num_threads(), numba.get_num_threads()
    torch.set_num_threads(count)
    numba.set_num_threads(min(count, numba.config.NUMBA_NUM_THREADS))
    try:
        with threadpool_limits(limits=count, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before_torch)
        numba.set_num_threads(before_numba)


def speed_table(layers: Layers, batches, repeats: int, tables: list) -> None:
    torch = layers.torch
    cuda = layers.device.type == "cuda"
    default = torch.get_num_threads()
    counts = ["device"] if cuda else sorted({1, default})
    table = Table(
        f"Speed: one PyTorch step (forward + backward of <pooled, g> + <z, h>) of each layer, "
        f"m={M} n={N} d={D} mu={MU} inverse_temperature={INVERSE_TEMPERATURE}, on "
        f"{layers.device}, the layers interleaved, median of {repeats}; x GSPPool = the "
        "layer's time / GSPPool's",
        ["dtype", "B", "threads", "GSPPool ms", "closed form ms", "unrolled ms",
         "closed form x GSPPool", "unrolled x GSPPool"])
    tables.append(table)
    sync = torch.cuda.synchronize if cuda else None
    for dtype in (torch.float32, torch.float64):
        for batch in batches:
            f, w, g, h = _tensors(torch, layers.device, dtype, *inputs(batch, M, N, D))
            calls = {name: (lambda name=name: layers.step(name, f, w, g, h, MU,
                                                           INVERSE_TEMPERATURE))
                     for name in LAYERS}
            for count in counts:
                with (contextlib.nullcontext() if cuda else threads(torch, count)):
                    if cuda:
                        for call in calls.values():
                            call()
                        times = timed_rounds(calls, repeats, sync=sync)
                        medians = {k: float(np.median(v)) for k, v in times.items()}
                    else:
                        medians = interleaved(calls, repeats)
                ms = [1e3 * medians[name] for name in LAYERS]
                table.add(str(dtype).replace("torch.", ""), batch, count,
                          *(f"{t:.2f}" for t in ms), f"{ms[1] / ms[0]:.2f}",
                          f"{ms[2] / ms[0]:.2f}")


def _skip(reason: str, args) -> int:
    print(f"bench_torch_gsp: skipped: {reason}")
    if args.json:
        write_json(args.json, script=__file__, argv=args.argv, tables=[], device=args.device,
                   notes=[f"skipped: {reason}"])
    return 0


def print_table(table: Table) -> None:
    print(f"\n{table.title}\n")
    print("| " + " | ".join(table.columns) + " |")
    print("|" + "|".join("---" for _ in table.columns) + "|")
    for row in table.rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true",
                        help="B = 8 for values and stability, B = 16 for speed, 2 repeats")
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per row (15)")
    parser.add_argument("--only", action="append", choices=("values", "stability", "speed"),
                        help="run only these tables (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write the tables to PATH")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.repeats < 1:
        parser.error(f"--repeats == {args.repeats}, must be >= 1")
    try:
        import torch
    except ImportError as exc:
        return _skip(f"torch cannot be imported ({exc})", args)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return _skip("torch sees no CUDA device", args)
        try:
            import cupy  # noqa: F401  (refdml.torch runs CUDA tensors on CuPy)
        except ImportError as exc:
            return _skip(f"refdml.torch needs CuPy for CUDA tensors ({exc})", args)
        device = torch.device("cuda", torch.cuda.current_device())
        import _torch_anchors

        _torch_anchors.use_full_float32()
    else:
        device = torch.device("cpu")
    layers = Layers(torch, device)
    repeats = 2 if args.quick else args.repeats
    small = 8 if args.quick else 64
    batches = (16,) if args.quick else (64, 256)
    tables: list[Table] = []
    wanted = args.only or ("values", "stability", "speed")
    print(f"torch {torch.__version__} on {device}; torch threads {torch.get_num_threads()}")
    if "values" in wanted:
        values_table(layers, small, tables)
        print_table(tables[-1])
    if "stability" in wanted:
        stability_table(layers, small, tables)
        print_table(tables[-1])
    if "speed" in wanted:
        speed_table(layers, batches, repeats, tables)
        print_table(tables[-1])
    if args.json:
        write_json(args.json, script=__file__, argv=args.argv, tables=tables,
                   device=str(device), notes=[f"torch {torch.__version__}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
