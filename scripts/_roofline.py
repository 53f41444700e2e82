"""Roofline estimates of the GPU benchmarks (scripts/bench_gpu.py ``--device cuda``): the bytes
that must move and the flops that must be done by each goal's work, at the sizes the GPU run
uses, and the lower bound on time they give on a named device (issue 35).

An estimate, never a measurement: ``max(bytes / bandwidth, flops / flop rate)`` assumes every
byte moves once at the device's copy bandwidth and every flop runs at its float32 matrix-product
rate, with no launch, synchronisation or host time. A GPU time can be read against it (how far
from the bound a path is); it says nothing about what a path achieves. Sizes are float32
(``itemsize`` 4); a flop is one multiply or add (a multiply-add is two).

    work = gsp_layer(256)
    bound = work.bound(H200_MEASURED)
    print(work.describe(H200_MEASURED))

Each work function's docstring derives its formulas. Devices: :data:`H200_MEASURED` (the copy
bandwidth and float32 matmul rate measured on the 2026-11-28 H200 run), :data:`H200_SPEC` and
:data:`H100_SXM_SPEC` (vendor peak memory bandwidth, no flop rate).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "DEVICES",
    "Bound",
    "Device",
    "H100_SXM_SPEC",
    "H200_MEASURED",
    "H200_SPEC",
    "Work",
    "gsp_layer",
    "kcenter",
    "retrieval",
    "section_works",
    "sinkhorn_pairs",
    "train_step",
]


def _check_positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} == {value!r}, must be finite and > 0")


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} == {value}, must be at least 1")


@dataclasses.dataclass(frozen=True)
class Device:
    """A device's memory bandwidth (bytes/s) and float32 flop rate (flop/s, or None where
    only the bandwidth is known), with where the figures come from."""

    name: str
    bandwidth: float
    flop_rate: float | None
    source: str

    def __post_init__(self) -> None:
        _check_positive(self.bandwidth, "bandwidth")
        if self.flop_rate is not None:
            _check_positive(self.flop_rate, "flop_rate")


#: Measured on the 2026-11-28 H200 run (shared/gpu-runs/2026-11-28-h200/README.md): a
#: device-to-device copy of the k-center points (read + written bytes over its time) and the
#: float32 ``cupy.matmul`` of the retrieval blocks.
H200_MEASURED = Device(
    "H200 (measured 2026-11-28)", 3.45e12, 36e12,
    "device copy bandwidth 3.45 TB/s and float32 matmul 36 TFLOP/s, measured on the "
    "2026-11-28 H200 run (shared/gpu-runs/2026-11-28-h200/README.md)")
#: NVIDIA's H200 datasheet: 4.8 TB/s of HBM3e.
H200_SPEC = Device("H200 (spec sheet)", 4.8e12, None,
                   "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e")
#: NVIDIA's H100 datasheet, SXM form factor: 3.35 TB/s of HBM3.
H100_SXM_SPEC = Device("H100 SXM (spec sheet)", 3.35e12, None,
                       "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3 (SXM)")
DEVICES = (H200_MEASURED, H200_SPEC, H100_SXM_SPEC)


@dataclasses.dataclass(frozen=True)
class Bound:
    """The lower bound of a work on a device: ``seconds = max(memory_s, compute_s)``;
    ``limited_by`` "memory" or "compute", or "memory term only" for a device without a
    flop rate (``compute_s`` None), where ``seconds`` is the memory term alone."""

    seconds: float
    memory_s: float
    compute_s: float | None
    limited_by: str


@dataclasses.dataclass(frozen=True)
class Work:
    """What one goal's call must do: ``bytes`` moved and ``flops`` done at ``size``, with the
    formulas (text) they come from; ``items`` per call in ``item_unit`` (for a rate goal)."""

    section: str
    name: str
    size: str
    goal: str
    bytes: float
    flops: float
    bytes_formula: str
    flops_formula: str
    items: float = 1.0
    item_unit: str = "calls"

    def bound(self, device: Device) -> Bound:
        if not isinstance(device, Device):
            raise TypeError(f"device must be a Device, got {type(device).__name__}")
        memory = self.bytes / device.bandwidth
        compute = None if device.flop_rate is None else self.flops / device.flop_rate
        if compute is None:
            return Bound(memory, memory, None, "memory term only")
        if compute > memory:
            return Bound(compute, memory, compute, "compute")
        return Bound(memory, memory, compute, "memory")

    def as_dict(self, device: Device) -> dict:
        """Plain types for a JSON row: the work, the device's figures and the bound."""
        bound = self.bound(device)
        return {"estimate": True, "work": self.name, "size": self.size, "goal": self.goal,
                "bytes": self.bytes, "flops": self.flops,
                "bytes_formula": self.bytes_formula, "flops_formula": self.flops_formula,
                "device": device.name, "device_source": device.source,
                "bandwidth_bytes_per_s": device.bandwidth, "flop_rate_per_s": device.flop_rate,
                "memory_s": bound.memory_s, "compute_s": bound.compute_s,
                "lower_bound_s": bound.seconds, "limited_by": bound.limited_by,
                "items_per_s_at_bound": self.items / bound.seconds, "item_unit": self.item_unit}

    def describe(self, device: Device) -> str:
        """One line: the work, the bound and what limits it, labelled as an estimate."""
        bound = self.bound(device)
        rate = ""
        if self.item_unit != "calls":
            rate = f", at most {self.items / bound.seconds:,.4g} {self.item_unit}/s"
        limit = ("memory term only: no flop rate for this device" if bound.compute_s is None
                 else f"{bound.limited_by}-bound")
        return (f"roofline estimate (not a measurement), {self.name} at {self.size}: "
                f"{_si(self.bytes, 'B')} moved, {_si(self.flops, 'FLOP')}; "
                f">= {_time(bound.seconds)} "
                f"({limit}{rate}) at {device.name}; goal {self.goal}")


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


# ------------------------------------------------------------------ the works
def gsp_layer(batch: int, m: int = 64, n: int = 49, d: int = 128, *, itemsize: int = 4) -> Work:
    r"""The GSP pooling layer, forward + backward (bench_gpu.py's ``gsp`` section: ``batch``
    256, goal < 0.5 ms; 4096, goal >= 2,000,000 images/s), p = 1.

    Bytes: the forward reads the features (B n d) and prototypes (m d) and writes pooled
    (B d) and z (B m); the backward reads the upstream gradients (B d + B m), the features
    and prototypes again and writes their gradients (B n d + m d):
    ``itemsize (3 B n d + 3 m d + 2 B d + 2 B m)``. Left out: the transport plan kept
    from the forward for the backward (B n m), which a backward could recompute.

    Flops: the cost map's inner products (B m n d multiply-adds, the GEMM of features by
    prototypes), in the backward its two contractions with the cost gradient (d features
    by the prototypes, d prototypes by the features: 2 B m n d), the pooled weighted sum
    :math:`\frac1n\sum_j w_j f_j` and its gradient to the features (B n d each):
    ``2 (3 B m n d + 2 B n d)``. Left out: the (P2) solver's iterations (each sweeps the
    B n m cost map elementwise, and their number depends on the data) and the norms.
    """
    _check_sizes(batch=batch, m=m, n=n, d=d, itemsize=itemsize)
    goal = "< 0.5 ms per call" if batch == 256 else (
        ">= 2,000,000 images/s" if batch == 4096 else "none at this size")
    return Work(
        "gsp", "GSP layer forward + backward", f"B={batch} m={m} n={n} d={d} float32", goal,
        bytes=itemsize * (3 * batch * n * d + 3 * m * d + 2 * batch * d + 2 * batch * m),
        flops=2 * (3 * batch * m * n * d + 2 * batch * n * d),
        bytes_formula="4 (3 B n d + 3 m d + 2 B d + 2 B m)",
        flops_formula="2 (3 B m n d + 2 B n d)", items=batch, item_unit="images")


#: The digits-collage study's model at its defaults (refdml.train.runs, RunConfig): 16 x 16
#: single-channel images, 3 x 3 convolutions with padding 1, channels (16, 32, 32), strides
#: (1, 2, 1), ReLU after each; a per-position linear layer to 64; a GSP head of 128
#: prototypes; a linear embedding of 64; the objective's zero-shot class embeddings (8 train
#: classes x 64), which the optimiser updates too.
DIGITS_COLLAGE = {"image": 16, "channels": (1, 16, 32, 32), "strides": (1, 2, 1), "kernel": 3,
                  "local_dim": 64, "n_prototypes": 128, "embedding_dim": 64,
                  "objective_parameters": 8 * 64}


def train_step(batch: int = 64, *, itemsize: int = 4, model: dict | None = None) -> Work:
    """One digits-collage training step (bench_gpu.py's ``train`` section: batch 64, goal
    < 5 ms): model forward and backward, the contrastive loss, an Adam step.

    Flops, as multiply-adds (times two): a convolution to ``C_out x H x W`` from ``C_in``
    channels is ``B C_out H W C_in k^2`` forward and twice that backward (the weight
    gradient and the input gradient; the first layer's input gradient is not needed, so
    once); the per-position linear layer from ``C`` to ``L`` over ``P = H W`` positions is
    ``B P C L`` forward, twice backward; the GSP head is :func:`gsp_layer`'s products with
    ``n = P``, ``d = L``, ``m`` prototypes (``3 B m n d + 2 B n d``); the embedding
    ``B L E``, thrice in all; the loss's pairwise distances ``B^2 E``, thrice. Left out: the
    ReLUs, norms, the (P2) solver's iterations and the zero-shot ridge solve of the
    objective (about a million multiply-adds, under 1 % of the rest), the optimiser's
    elementwise update.

    Bytes: each activation written once by the forward and read once by the backward
    (a layer-by-layer implementation, as refdml's: a fused one could keep them on chip),
    plus the input batch, and for every parameter: read in the forward and the backward,
    its gradient written, and Adam's read and write of the parameter and its two moments
    (``2 + 1 + 6`` per parameter).
    """
    _check_sizes(batch=batch, itemsize=itemsize)
    spec = dict(DIGITS_COLLAGE, **(model or {}))
    size, channels, kernel = spec["image"], spec["channels"], spec["kernel"]
    macs = 0
    activations = 0
    params = 0
    for layer, (c_in, c_out, stride) in enumerate(zip(channels[:-1], channels[1:],
                                                      spec["strides"])):
        size = -(-size // stride)                     # padding 1, 3 x 3: ceil(size / stride)
        forward = batch * c_out * size * size * c_in * kernel * kernel
        macs += forward * (2 if layer == 0 else 3)
        activations += 2 * batch * c_out * size * size      # convolution and ReLU outputs
        params += c_out * c_in * kernel * kernel + c_out
    positions, width = size * size, channels[-1]
    local, m, embedding = spec["local_dim"], spec["n_prototypes"], spec["embedding_dim"]
    macs += 3 * batch * positions * width * local
    activations += batch * positions * local
    params += width * local + local
    macs += 3 * batch * m * positions * local + 2 * batch * positions * local
    activations += batch * m * positions + batch * local + batch * m   # plan, pooled, z
    params += m * local
    macs += 3 * batch * local * embedding + 3 * batch * batch * embedding
    activations += 2 * batch * embedding                    # embedding, normalised
    params += local * embedding + embedding + spec["objective_parameters"]
    inputs = batch * channels[0] * spec["image"] ** 2
    return Work(
        "train", "digits-collage train step", f"batch {batch} float32", "< 5 ms per step",
        bytes=itemsize * (inputs + 2 * activations + 9 * params), flops=2 * macs,
        bytes_formula="4 (input + 2 x activations + 9 x parameters)",
        flops_formula="2 x (convolutions 3x, first 2x; local 3 B P C L; GSP 3 B m P L + "
                      "2 B P L; embedding 3 B L E; loss 3 B^2 E) multiply-adds",
        items=1, item_unit="calls")


def retrieval(n_query: int = 10_000, n_ref: int = 1_000_000, d: int = 128, *,
              itemsize: int = 4) -> Work:
    """Retrieval of ``n_query`` queries against ``n_ref`` references of dimension ``d``
    (bench_gpu.py's ``retrieval`` section; goal: within 2x the float32 matmul bound, and
    faster than torch matmul + topk).

    Flops: every query-reference inner product, the float32 GEMM of the queries by the
    references: ``2 Q N d``. Bytes: the references and the queries read at least once,
    ``itemsize (N d + Q d)``; left out: the labels of the neighbours and the results
    (about ``Q k`` values)."""
    _check_sizes(n_query=n_query, n_ref=n_ref, d=d, itemsize=itemsize)
    return Work(
        "retrieval", "retrieval metrics", f"{n_query} queries x {n_ref} references x {d} "
        "float32", "<= 2x the float32 matmul bound, faster than torch matmul + topk",
        bytes=itemsize * (n_ref * d + n_query * d), flops=2 * n_query * n_ref * d,
        bytes_formula="4 (N d + Q d)", flops_formula="2 Q N d", items=n_query,
        item_unit="queries")


def kcenter(n: int = 1_000_000, d: int = 128, k: int = 1000, *, itemsize: int = 4) -> Work:
    """Greedy k-center of ``n`` points in ``d`` dimensions, ``k`` picks (bench_gpu.py's
    ``kcenter`` section; goal >= 0.7x the bandwidth bound).

    Bytes: each pick reads every point once to update the distances to the nearest centre
    (the points do not fit in any cache): ``k n d itemsize``. bench_gpu.py's own
    "memory-bandwidth bound" row also counts the running distances read and written per
    pick, ``k n (d + 2) itemsize``, which can stay in the L2 cache. Flops: per pick and
    point, the squared distance to the new centre, a difference, a square and a sum per
    coordinate: ``3 k n d``; left out: the ``k n`` minimum updates and the ``k`` argmax
    reductions."""
    _check_sizes(n=n, d=d, k=k, itemsize=itemsize)
    return Work(
        "kcenter", "greedy k-center", f"n={n} d={d} k={k} float32",
        ">= 0.7x the memory-bandwidth bound", bytes=itemsize * k * n * d, flops=3 * k * n * d,
        bytes_formula="4 k n d", flops_formula="3 k n d", items=k, item_unit="picks")


def sinkhorn_pairs(n_clouds: int = 1024, n_points: int = 49, d: int = 128, *,
                   iterations: int = 1, itemsize: int = 4) -> Work:
    """All-pairs Sinkhorn divergence of ``n_clouds`` clouds of ``n_points`` points
    (bench_gpu.py's ``sinkhorn`` section; goal >= 20x POT's problems per second).

    ``P = C (C - 1) / 2 + C`` entropic OT problems (the pairs and each cloud with itself).
    Flops: each problem's squared-Euclidean cost matrix by inner products, ``2 n^2 d``, and
    per Sinkhorn iteration two log-sum-exp half steps over the ``n x n`` matrix, counted as
    4 operations per entry each (an add, a max, an exp, a sum): ``8 n^2``; the iteration
    count depends on the data and is not known before a run, so ``iterations`` (default 1)
    gives a floor: ``P (2 n^2 d + 8 n^2 iterations)``. Bytes: the clouds read once and the
    ``C x C`` divergence matrix written, ``itemsize (C n d + C^2)``; a problem's cost matrix
    (``n^2`` values) need never leave the chip."""
    _check_sizes(n_clouds=n_clouds, n_points=n_points, d=d, iterations=iterations,
                 itemsize=itemsize)
    problems = n_clouds * (n_clouds - 1) // 2 + n_clouds
    square = n_points * n_points
    return Work(
        "sinkhorn", "all-pairs Sinkhorn divergence",
        f"{n_clouds} clouds of {n_points} points in R^{d} float32, {problems} problems, "
        f"{iterations} Sinkhorn iteration{'s' if iterations != 1 else ''} counted",
        ">= 20x POT's problems/s", bytes=itemsize * (n_clouds * n_points * d + n_clouds ** 2),
        flops=problems * (2 * square * d + 8 * square * iterations),
        bytes_formula="4 (C n d + C^2)", flops_formula="P (2 n^2 d + 8 n^2 iterations)",
        items=problems, item_unit="problems")


def section_works(section: str) -> list[Work]:
    """The works of bench_gpu.py's CUDA section ``section`` at the GPU run's sizes (none for
    a section without a goal of its own, e.g. ``launch_sync``)."""
    works = {"gsp": lambda: [gsp_layer(256), gsp_layer(4096)], "train": lambda: [train_step()],
             "retrieval": lambda: [retrieval()], "kcenter": lambda: [kcenter()],
             "sinkhorn": lambda: [sinkhorn_pairs()]}
    if not isinstance(section, str):
        raise TypeError(f"section must be a str, got {type(section).__name__}")
    return works[section]() if section in works else []
