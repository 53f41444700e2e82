r"""Convolution by im2col, and the per-location linear map (1x1 conv) to local features.

Layout NCHW: ``x`` (B, C, H, W), ``weight`` (C_out, C, k, k), ``bias`` (C_out). With
padding ``p`` and stride ``s`` the output is (B, C_out, H_o, W_o),
``H_o = (H + 2p - k) // s + 1`` (likewise ``W_o``), and

.. math::
    y_{b o u v} = b_o + \sum_{c, i, j} W_{o c i j}\, \tilde x_{b, c, s u + i, s v + j}

with ``x~`` the zero-padded input. im2col gathers, for every output location
``(b, u, v)``, the patch ``x~[b, :, s u : s u + k, s v + k]`` into one row of
``cols`` (B H_o W_o, C k k), so the convolution is one matrix product ``cols W^T + b``.
The loop runs over the ``k^2`` kernel offsets ``(i, j)``, never over the batch: for a
fixed offset, the strided slice ``x~[:, :, i : i + s H_o : s, j : j + s W_o : s]`` is
column ``(., i, j)`` of every patch at once.

Memory layout (the maths above does not depend on it). The public :func:`im2col` orders
the columns ``(c, i, j)``, as ``weight.reshape(C_out, -1)``. Inside the layer, on NumPy,
the patches are gathered channels-last: the padded input is copied once to (B, H + 2p, W + 2p, C),
the columns are ordered ``(i, j, c)`` and the weight is permuted to match
(``weight.transpose(0, 2, 3, 1)``), so every copy and every scatter-add moves runs of
``C`` or more contiguous numbers (on NumPy the gather is one copy from a window view,
whose rows of ``k C`` numbers are contiguous). The output ``y`` is the NCHW view of the
product's (B, H_o, W_o, C_out) rows (no transposed copy), and the layers after it
(ReLU, the next convolution, :func:`local_linear_forward`) read it in that order at no
cost. Only the order of the terms of each dot product differs from the ``(c, i, j)``
order, so results agree to rounding.

Backward. The map ``x -> cols`` is linear, so its adjoint col2im (``x = col2im(cols)``)
scatter-ADDS every patch entry back where it came from (overlapping patches sum; the
padding is cropped): ``<im2col(x), c> = <x, col2im(c)>`` for all ``x, c``. With
``g = d_y`` laid out as (B H_o W_o, C_out): ``d_W = g^T cols``, ``d_b = g^T 1`` (the sum
over locations), ``d_x = col2im(g W)``. The context keeps ``cols`` (the backward needs it
for ``d_W``; recomputing it from ``x`` would cost a second im2col). col2im is the same
loop over the kernel offsets with ``+=`` in place of the copy; within one offset no two
patch entries land on the same pixel, so each ``+=`` is a plain strided add (no
``np.add.at``). On NumPy the backward never holds ``g W`` (B H_o W_o, k k C) whole: its column
block ``(i, j)`` is ``g W[:, :, i, j]``, formed in one reused (B H_o W_o, C) buffer and
added at offset ``(i, j)`` (:func:`_conv_input_grad`).

On a device (CuPy) the k^2 strided copies and adds would be k^2 kernel launches each
way. There the gather is one ``take`` by a precomputed index instead: each image is laid
out flat as its pixels channels-last, then C zeros (the padding's value), and entry
``(u, v, c, i, j)`` of the index names channel ``c`` of pixel ``(s u + i - p, s v + j - p)``,
or a zero where that pixel is in the padding. The columns come out in :func:`im2col`'s
order ``(c, i, j)``, so the weight is its own free (C_out, C k k) view (no permuted copy)
and ``d_W`` needs none either. col2im is one scatter-add by the same index into zeros
of that flat layout (the padding's entries are dropped after). The index depends on the
geometry and the channel count, not on the batch: it is built once on the host and
uploaded once per device (:mod:`refdml.train._constants`), so a call copies nothing
from the host. The same numbers are gathered either way; the scatter-add sums colliding
entries in an unspecified order (atomics on a GPU), so col2im agrees with the loop to
rounding.

The per-location linear map (a 1x1 convolution) turns a feature map into the local
features of the pooling heads:

.. math::
    f_{b, j, :} = W\, x_{b, :, h_j, w_j} + b,\qquad j = h W + w \in [0, n = H W),

``x`` (B, C, H, W) -> ``f`` (B, n, d), row-major over the locations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    _describe,
    as_inputs,
    check_context,
    check_flag,
    check_rng,
    check_upstream_like,
)
from refdml._backend import get_backend
from refdml.gpu.linalg import matmul
from refdml.train._constants import constant, filled
from refdml.train._dense import _bounded_int, _positive_int, dense_init
from refdml.train._layer import Layer, init_array

__all__ = [
    "Conv2d",
    "Conv2dContext",
    "Conv2dGrads",
    "LocalLinear",
    "LocalLinearContext",
    "LocalLinearGrads",
    "col2im",
    "conv2d_backward",
    "conv2d_forward",
    "conv_output_size",
    "im2col",
    "local_linear_backward",
    "local_linear_forward",
]


def _nonnegative_int(value, name: str) -> int:
    return _bounded_int(value, name, low=0)


def _geometry(kernel_size, stride, padding) -> tuple[int, int, int]:
    return (_positive_int(kernel_size, "kernel_size"), _positive_int(stride, "stride"),
            _nonnegative_int(padding, "padding"))


def conv_output_size(size: int, kernel_size: int, stride: int, padding: int) -> int:
    """``(size + 2 padding - kernel_size) // stride + 1``; ValueError when below 1.

    ``size``, ``kernel_size`` and ``stride`` are ints >= 1, ``padding`` an int >= 0.
    """
    return _output_size(_positive_int(size, "size"), *_geometry(kernel_size, stride, padding))


def _output_size(size: int, kernel_size: int, stride: int, padding: int) -> int:
    out = (size + 2 * padding - kernel_size) // stride + 1
    if out < 1:
        raise ValueError(
            f"input size {size} with padding {padding} is smaller than the kernel "
            f"({kernel_size}): no output location"
        )
    return out


def im2col(x, kernel_size: int, *, stride: int = 1, padding: int = 0):
    """Patches of ``x`` (B, C, H, W) as rows: (B H_o W_o, C k k), rows ordered (b, u, v),
    columns ``(c, i, j)``."""
    kernel_size, stride, padding = _geometry(kernel_size, stride, padding)
    _, _, a = as_inputs({"x": (x, 4)})
    k, channels = kernel_size, a["x"].shape[1]
    cols, channels_last = _im2col(a["x"], k, stride, padding)
    if not channels_last:
        return cols
    return cols.reshape(-1, k, k, channels).transpose(0, 3, 1, 2).reshape(-1, channels * k * k)


def _im2col(x, kernel_size: int, stride: int, padding: int, out=None):
    """``(cols, channels_last)``: the patches of ``x`` (B, C, H, W) as (B H_o W_o, k k C),
    columns ``(i, j, c)`` (``channels_last``: NumPy's window copy, into ``out`` if given),
    or as (B H_o W_o, C k k), columns ``(c, i, j)`` (a device's gather by index); module
    doc."""
    if get_backend(x).launch_bound:
        return _gather_by_index(x, kernel_size, stride, padding), False
    batch, channels, height, width = x.shape
    k, s, p = kernel_size, stride, padding
    h_out = _output_size(height, k, s, p)
    w_out = _output_size(width, k, s, p)
    rows = x.transpose(0, 2, 3, 1)   # free when x is the NCHW view of a conv's output
    if p:
        padded = np.zeros((batch, height + 2 * p, width + 2 * p, channels), dtype=x.dtype)
        padded[:, p:p + height, p:p + width, :] = rows
    else:
        padded = rows
    shape = (batch, h_out, w_out, k, k, channels)
    cols = np.empty(shape, dtype=x.dtype) if out is None else out.reshape(shape)
    # One copy from the window view: its (j, c) block of k C numbers is contiguous in
    # the source, where a loop over the offsets would copy runs of C numbers.
    windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(1, 2))
    np.copyto(cols, windows[:, ::s, ::s].transpose(0, 1, 2, 4, 5, 3))
    return cols.reshape(batch * h_out * w_out, k * k * channels), True


@functools.lru_cache(maxsize=64)
def _host_patch_index(height: int, width: int, channels: int, kernel_size: int, stride: int,
                      padding: int) -> tuple[np.ndarray, bool]:
    """The gather index of the device path (module doc), flat over ``(u, v, c, i, j)``, into
    an image flattened as (H W + 1, C) (the last pixel the padding's zeros); and whether
    any entry names the padding."""
    k, s, p = kernel_size, stride, padding
    h_out = _output_size(height, k, s, p)
    w_out = _output_size(width, k, s, p)
    rows = s * np.arange(h_out)[:, None] + np.arange(k)[None, :] - p    # (u, i)
    columns = s * np.arange(w_out)[:, None] + np.arange(k)[None, :] - p  # (v, j)
    inside = (((rows >= 0) & (rows < height))[:, None, None, :, None]
              & ((columns >= 0) & (columns < width))[None, :, None, None, :])
    pixel = np.where(inside, rows[:, None, None, :, None] * width
                     + columns[None, :, None, None, :], height * width)
    index = (pixel * channels + np.arange(channels)[None, None, :, None, None]).reshape(-1)
    index = index.astype(np.intp)
    index.flags.writeable = False
    return index, not bool(inside.all())


def _patch_index(like, height: int, width: int, channels: int, kernel_size: int, stride: int,
                 padding: int) -> tuple[Any, bool]:
    """:func:`_host_patch_index` on ``like``'s module and device, kept (:func:`constant`)."""
    geometry = (height, width, channels, kernel_size, stride, padding)
    pads = _host_patch_index(*geometry)[1]
    return constant(like, ("patch_index",) + geometry,
                     lambda: _host_patch_index(*geometry)[0]), pads


def _gather_by_index(x, kernel_size: int, stride: int, padding: int):
    """The patches of ``x`` (B, C, H, W) as (B H_o W_o, C k k), columns ``(c, i, j)``, by one
    gather (module doc; any array module)."""
    xp = get_backend(x).xp
    batch, channels, height, width = x.shape
    h_out = _output_size(height, kernel_size, stride, padding)
    w_out = _output_size(width, kernel_size, stride, padding)
    index, pads = _patch_index(x, height, width, channels, kernel_size, stride, padding)
    # A free view when x is the NCHW view of a conv's output (channels-last in memory).
    source = x.transpose(0, 2, 3, 1).reshape(batch, height * width * channels)
    if pads:
        zeros = xp.broadcast_to(filled(x, 0.0, (1, 1)), (batch, channels))
        source = xp.concatenate((source, zeros), axis=1)
    cols = xp.take(source, index, axis=1)   # (B, H_o W_o C k k)
    return cols.reshape(batch * h_out * w_out, channels * kernel_size * kernel_size)


def _scatter_by_index(cols, x_shape: tuple[int, int, int, int], kernel_size: int,
                      stride: int, padding: int):
    """The adjoint of :func:`_gather_by_index`: ``cols`` (B H_o W_o, C k k) scatter-added
    into the NCHW view of a channels-last array of ``x_shape`` (any array module)."""
    ns = get_backend(cols)
    batch, channels, height, width = x_shape
    index, pads = _patch_index(cols, height, width, channels, kernel_size, stride, padding)
    size = height * width * channels
    target = ns.xp.zeros((batch, size + pads * channels), dtype=cols.dtype)
    ns.scatter_add(target, (slice(None), index), cols.reshape(batch, -1))
    # The last C entries, if any, hold what the padding received: dropped.
    return target[:, :size].reshape(batch, height, width, channels).transpose(0, 3, 1, 2)


def col2im(cols, x_shape: tuple[int, int, int, int], kernel_size: int, *,
           stride: int = 1, padding: int = 0):
    """The adjoint of :func:`im2col`: scatter-add the rows of ``cols`` back into ``x_shape``.

    ``cols`` has :func:`im2col`'s column order ``(c, i, j)``.

    ``x_shape`` is ``(B, C, H, W)`` (ints >= 1); ``cols`` must have the shape
    ``(B H_o W_o, C k k)`` that :func:`im2col` gives for it.
    """
    kernel_size, stride, padding = _geometry(kernel_size, stride, padding)
    if not isinstance(x_shape, (tuple, list)) or len(x_shape) != 4:
        raise TypeError(f"x_shape must be a tuple (B, C, H, W), got {_describe(x_shape)}")
    x_shape = tuple(_positive_int(n, f"x_shape[{i}]") for i, n in enumerate(x_shape))
    _, _, a = as_inputs({"cols": (cols, 2)})
    batch, channels, height, width = x_shape
    expected = (batch * _output_size(height, kernel_size, stride, padding)
                * _output_size(width, kernel_size, stride, padding),
                channels * kernel_size * kernel_size)
    if tuple(a["cols"].shape) != expected:
        raise ValueError(f"cols has shape {tuple(a['cols'].shape)}, im2col gives {expected} for "
                         f"x_shape {x_shape} and this kernel, stride and padding")
    k = kernel_size
    if get_backend(a["cols"]).launch_bound:
        return _scatter_by_index(a["cols"], x_shape, k, stride, padding)
    channels_last = a["cols"].reshape(-1, channels, k, k).transpose(0, 2, 3, 1)
    return _col2im(channels_last.reshape(-1, k * k * channels), x_shape, k, stride, padding)


def _col2im(cols, x_shape: tuple[int, int, int, int], kernel_size: int, stride: int,
            padding: int):
    """The adjoint of NumPy's :func:`_im2col` (columns ``(i, j, c)``); the NCHW view of a
    channels-last array."""
    batch, channels, height, width = x_shape
    k, s, p = kernel_size, stride, padding
    h_out = _output_size(height, k, s, p)
    w_out = _output_size(width, k, s, p)
    patches = cols.reshape(batch, h_out, w_out, k, k, channels)
    padded = np.zeros((batch, height + 2 * p, width + 2 * p, channels), dtype=cols.dtype)
    for i in range(k):
        for j in range(k):
            # One offset touches each padded pixel at most once: no collision inside the +=.
            padded[:, i:i + s * (h_out - 1) + 1:s, j:j + s * (w_out - 1) + 1:s, :] += (
                patches[:, :, :, i, j, :]
            )
    return padded[:, p:p + height, p:p + width, :].transpose(0, 3, 1, 2)


def _conv_input_grad(g, weight_matrix, x_shape: tuple[int, int, int, int], kernel_size: int,
                     stride: int, padding: int, channels_last: bool):
    """``col2im(g W)`` of the convolution, ``W`` = ``weight_matrix`` (C_out, k k C) with
    columns ``(i, j, c)`` where ``channels_last`` (NumPy), else (C_out, C k k), ``(c, i, j)``.

    ``g`` (B H_o W_o, C_out). On a device: one product and one scatter-add (module doc).
    On NumPy without forming ``g W``: its column block ``(i, j)`` is ``g W[:, (i, j), :]``
    (B H_o W_o, C), each computed into one buffer and added at its offset, so the
    (B H_o W_o, k k C) product is never held in memory.
    """
    if not channels_last:
        return _scatter_by_index(matmul(get_backend(g), g, weight_matrix), x_shape,
                                 kernel_size, stride, padding)
    batch, channels, height, width = x_shape
    p = padding
    padded = np.zeros((batch, height + 2 * p, width + 2 * p, channels), dtype=g.dtype)
    _add_input_grad(g, weight_matrix, padded, kernel_size, stride)
    return padded[:, p:p + height, p:p + width, :].transpose(0, 3, 1, 2)


def _add_input_grad(g, weight_matrix, padded, kernel_size: int, stride: int) -> None:
    """NumPy's ``col2im(g W)`` added into ``padded`` (B, H + 2p, W + 2p, C), channels-last
    (:func:`_conv_input_grad`), for the images whose rows ``g`` (B H_o W_o, C_out) holds."""
    batch, _, _, channels = padded.shape
    k, s = kernel_size, stride
    h_out = (padded.shape[1] - k) // s + 1
    w_out = (padded.shape[2] - k) // s + 1
    per_offset = weight_matrix.reshape(-1, k, k, channels)   # (C_out, k, k, C)
    block = np.empty((g.shape[0], channels), dtype=g.dtype)
    for i in range(k):
        for j in range(k):
            np.matmul(g, per_offset[:, i, j, :], out=block)
            # One offset touches each padded pixel at most once: no collision inside the +=.
            padded[:, i:i + s * (h_out - 1) + 1:s, j:j + s * (w_out - 1) + 1:s, :] += (
                block.reshape(batch, h_out, w_out, channels)
            )


def _weight_matrix(weight, channels_last: bool):
    """``weight`` (C_out, C, k, k) as the matrix of :func:`_im2col`'s columns: (C_out, k k C)
    where ``channels_last`` (a permuted copy), else (C_out, C k k) (a free view)."""
    if channels_last:
        weight = weight.transpose(0, 2, 3, 1)
    return weight.reshape(weight.shape[0], -1)


# --------------------------------------------------------------------------- conv2d
@dataclass(frozen=True)
class Conv2dContext:
    """``cols`` (the input's patches), ``channels_last`` (their columns are ordered
    ``(i, j, c)``, else ``(c, i, j)``: see the module doc), ``weight``, ``weight_matrix``
    (the weight as the matrix of those columns), ``x_shape``, ``stride``, ``padding``,
    ``y_shape``."""

    cols: Any
    channels_last: bool
    weight: Any
    weight_matrix: Any
    x_shape: tuple[int, int, int, int]
    stride: int
    padding: int
    y_shape: tuple[int, int, int, int]


@dataclass(frozen=True)
class Conv2dGrads:
    x: Any
    weight: Any
    bias: Any


def conv2d_forward(x, weight, bias, *, stride: int = 1, padding: int = 1):
    """2-D convolution (cross-correlation) of ``x`` (B, C, H, W) by im2col (module doc).

    ``weight`` (C_out, C, k, k) with a square kernel, ``bias`` (C_out). Returns
    ``(y (B, C_out, H_o, W_o), ctx)``.

    Parameters
    ----------
    x : float array (B, C, H, W)
        The input images.
    weight : float array (C_out, C, k, k)
        The square kernels.
    bias : float array (C_out,)
        One bias per output channel.
    stride : int >= 1
        The step between output positions (default 1).
    padding : int >= 0
        Zeros added on each side of ``H`` and ``W`` (default 1).
    """
    stride = _positive_int(stride, "stride")
    padding = _nonnegative_int(padding, "padding")
    _, _, a = as_inputs({"x": (x, 4), "weight": (weight, 4), "bias": (bias, 1)})
    x, weight, bias = a["x"], a["weight"], a["bias"]
    c_out, c_in, k, k2 = weight.shape
    if k != k2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, the kernel must be square")
    if x.shape[1] != c_in:
        raise ValueError(
            f"x has {x.shape[1]} channels (shape {tuple(x.shape)}), weight expects {c_in}"
        )
    if bias.shape[0] != c_out:
        raise ValueError(f"bias has shape {tuple(bias.shape)}, must be ({c_out},)")
    batch, _, height, width = x.shape
    h_out = _output_size(height, k, stride, padding)
    w_out = _output_size(width, k, stride, padding)
    ns = get_backend(x)
    if ns.launch_bound:
        cols, channels_last = _im2col(x, k, stride, padding)
        weight_matrix = _weight_matrix(weight, channels_last)   # the backward's g W uses it
        y = matmul(ns, cols, weight_matrix.T)
        y += bias
    else:
        cols, y, weight_matrix, channels_last = _conv_by_halves(ns, x, weight, bias, stride,
                                                                padding, h_out * w_out)
    y = y.reshape(batch, h_out, w_out, c_out).transpose(0, 3, 1, 2)
    return y, Conv2dContext(
        cols=cols, channels_last=channels_last, weight=weight, weight_matrix=weight_matrix,
        x_shape=tuple(x.shape),
        stride=stride, padding=padding, y_shape=tuple(y.shape),
    )


def _conv_by_halves(ns, x, weight, bias, stride: int, padding: int, per_image: int):
    """NumPy's forward: ``(cols, y (B H_o W_o, C_out), weight_matrix, channels_last)``, the
    patches and the product of each half of the batch (:meth:`Backend.halves`: on two
    cores inside ``side_thread``) written into their rows of ``cols`` and ``y``. An
    image's rows of the product are its own: only which thread computes them changes."""
    c_out, c_in, k, _ = weight.shape
    weight_matrix = _weight_matrix(weight, True)
    cols = np.empty((x.shape[0] * per_image, k * k * c_in), dtype=x.dtype)
    y = np.empty((x.shape[0] * per_image, c_out), dtype=x.dtype)

    def images(part):
        rows = slice(part.start * per_image, part.stop * per_image)
        _im2col(x[part], k, stride, padding, out=cols[rows])
        matmul(ns, cols[rows], weight_matrix.T, out=y[rows])
        y[rows] += bias

    ns.halves(images, x.shape[0])
    return cols, y, weight_matrix, True


def conv2d_backward(ctx: Conv2dContext, d_y, *, input_grad: bool = True) -> Conv2dGrads:
    """Gradients ``.x``, ``.weight``, ``.bias`` of :func:`conv2d_forward` (module doc).

    ``input_grad=False`` leaves ``.x`` as None: the first layer of a model, whose input is
    data, needs no input gradient, and it is the costliest of the three (PyTorch skips it
    for an input that does not require a gradient, likewise). ``.weight`` may be a
    non-contiguous view (of the channels-last product).
    """
    check_context(ctx, "ctx", Conv2dContext)
    input_grad = check_flag(input_grad, "input_grad")
    d_y = check_upstream_like(d_y, "d_y", ctx.y_shape, ctx.weight)
    c_out = ctx.weight.shape[0]
    k = ctx.weight.shape[-1]
    c_in = ctx.weight.shape[1]
    # A free view when d_y is channels-last in memory, as the layers above give it.
    g = d_y.transpose(0, 2, 3, 1).reshape(-1, c_out)
    ns = get_backend(g)
    if ctx.channels_last:
        x, d_weight, d_bias = _conv_backward_by_halves(ns, g, ctx, input_grad)
    else:
        # The parameters' products read g and the patches and nothing of the input's
        # gradient: beside it (Backend.alongside; at once on a device).
        parameters = ns.alongside(_conv_parameter_grads, ns, g, ctx.cols)
        x = (_conv_input_grad(g, ctx.weight_matrix, ctx.x_shape, k, ctx.stride, ctx.padding,
                              ctx.channels_last) if input_grad else None)
        d_weight, d_bias = parameters.result()
    if ctx.channels_last:
        d_weight = d_weight.reshape(c_out, k, k, c_in).transpose(0, 3, 1, 2)
    else:
        d_weight = d_weight.reshape(c_out, c_in, k, k)
    return Conv2dGrads(x=x, weight=d_weight, bias=d_bias)


def _conv_backward_by_halves(ns, g, ctx: Conv2dContext, input_grad: bool):
    """NumPy's backward: ``(d_x or None, g^T cols, 1^T g)``, each half of the batch
    (:meth:`Backend.halves`: on two cores inside ``side_thread``) adding its images' input
    gradient into their own rows of one padded buffer and forming its own parameter
    products, the two summed after: always two halves, so the sums' order does not depend
    on the setting."""
    batch, channels, height, width = ctx.x_shape
    per_image = g.shape[0] // batch
    p = ctx.padding
    padded = (np.zeros((batch, height + 2 * p, width + 2 * p, channels), dtype=g.dtype)
              if input_grad else None)

    def images(part):
        rows = slice(part.start * per_image, part.stop * per_image)
        if input_grad:
            _add_input_grad(g[rows], ctx.weight_matrix, padded[part], ctx.weight.shape[-1],
                            ctx.stride)
        return _conv_parameter_grads(ns, g[rows], ctx.cols[rows])

    (d_weight, d_bias), *rest = ns.halves(images, batch)
    for weight_part, bias_part in rest:      # the second half's, where there are two
        d_weight = d_weight + weight_part
        d_bias = d_bias + bias_part
    x = (padded[:, p:p + height, p:p + width, :].transpose(0, 3, 1, 2) if input_grad
         else None)
    return x, d_weight, d_bias


def _conv_parameter_grads(ns, g, cols):
    """``(g^T cols, 1^T g)``: the weight's gradient as the matrix of the patches' columns,
    and the bias's (a matrix-vector product, much faster than a reduction over g's long
    axis)."""
    return matmul(ns, g.T, cols), matmul(ns, filled(g, 1.0, (g.shape[0],)), g)


# --------------------------------------------------------------------------- 1x1 conv
@dataclass(frozen=True)
class LocalLinearContext:
    """``features`` = the input as (B, n, C), ``weight`` (d, C), ``x_shape``, ``y_shape``."""

    features: Any
    weight: Any
    x_shape: tuple[int, int, int, int]
    y_shape: tuple[int, int, int]


@dataclass(frozen=True)
class LocalLinearGrads:
    x: Any
    weight: Any
    bias: Any


def local_linear_forward(x, weight, bias):
    """Per-location linear map (1x1 conv): ``x`` (B, C, H, W) -> local features (B, H W, d).

    ``weight`` (d, C), ``bias`` (d); location ``j = h W + w``. Returns ``(f, ctx)``.

    Parameters
    ----------
    x : float array (B, C, H, W)
        The feature maps.
    weight : float array (d, C)
        The per-location linear map.
    bias : float array (d,)
        Its bias.
    """
    _, _, a = as_inputs({"x": (x, 4), "weight": (weight, 2), "bias": (bias, 1)})
    x, weight, bias = a["x"], a["weight"], a["bias"]
    batch, channels, height, width = x.shape
    if weight.shape[1] != channels:
        raise ValueError(
            f"x has {channels} channels (shape {tuple(x.shape)}), weight expects {weight.shape[1]}"
        )
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(f"bias has shape {tuple(bias.shape)}, must be ({weight.shape[0]},)")
    # Channels-last (B, n, C): a free view of a convolution's output (see the module doc).
    features = x.transpose(0, 2, 3, 1).reshape(batch, height * width, channels)
    # One (B n, C) x (C, d) product, not B small ones.
    y = matmul(get_backend(features), features.reshape(-1, channels),
               weight.T).reshape(batch, height * width, -1)
    y += bias
    return y, LocalLinearContext(
        features=features, weight=weight, x_shape=tuple(x.shape), y_shape=tuple(y.shape)
    )


def local_linear_backward(ctx: LocalLinearContext, d_y) -> LocalLinearGrads:
    """Gradients ``.x`` (B, C, H, W), ``.weight``, ``.bias`` of :func:`local_linear_forward`."""
    check_context(ctx, "ctx", LocalLinearContext)
    d_y = check_upstream_like(d_y, "d_y", ctx.y_shape, ctx.weight)
    d, channels = ctx.weight.shape
    batch, _, height, width = ctx.x_shape
    flat = d_y.reshape(-1, d)
    ns = get_backend(flat)
    d_weight = ns.alongside(matmul, ns, flat.T, ctx.features.reshape(-1, channels))
    d_features = matmul(ns, flat, ctx.weight)  # (B n, C), channels-last
    return LocalLinearGrads(
        x=d_features.reshape(batch, height, width, channels).transpose(0, 3, 1, 2),
        weight=d_weight.result(),
        bias=flat.sum(axis=0),
    )


# --------------------------------------------------------------------------- layers
class Conv2d(Layer):
    """Convolution by im2col (:func:`conv2d_forward`), NCHW, square ``kernel_size`` (3).

    He-normal weights (``std = sqrt(2 / (C k^2))``, for a following ReLU), zero bias.
    ``input_grad=False``: :meth:`backward` returns None instead of the input's gradient
    (a model's first layer, on data).
    """

    def __init__(self, c_in: int, c_out: int, *, kernel_size: int = 3, stride: int = 1,
                 padding: int = 1, rng=None, dtype=np.float64, device: str = "cpu",
                 name: str = "conv", input_grad: bool = True) -> None:
        super().__init__(name)
        self.input_grad = check_flag(input_grad, "input_grad")
        c_in, c_out = _positive_int(c_in, "c_in"), _positive_int(c_out, "c_out")
        k = _positive_int(kernel_size, "kernel_size")
        self.stride = _positive_int(stride, "stride")
        self.padding = _nonnegative_int(padding, "padding")
        rng = check_rng(rng)
        values = rng.standard_normal((c_out, c_in, k, k)) * np.sqrt(2.0 / (c_in * k * k))
        self.weight = self.add_parameter("weight", init_array(values, dtype, device))
        self.bias = self.add_parameter("bias", init_array(np.zeros(c_out), dtype, device))

    def forward(self, x):
        return conv2d_forward(x, self.weight.value, self.bias.value,
                              stride=self.stride, padding=self.padding)

    def backward(self, ctx, d_y):
        grads = conv2d_backward(ctx, d_y, input_grad=self.input_grad)
        self.weight.accumulate(grads.weight)
        self.bias.accumulate(grads.bias)
        return grads.x


class LocalLinear(Layer):
    """Per-location linear map (1x1 conv, :func:`local_linear_forward`): (B, C, H, W) -> (B, n, d).

    Glorot-uniform weights (``init="he"`` for He-normal), zero bias.
    """

    def __init__(self, c_in: int, d: int, *, rng=None, init: str = "glorot",
                 dtype=np.float64, device: str = "cpu", name: str = "local") -> None:
        super().__init__(name)
        c_in, d = _positive_int(c_in, "c_in"), _positive_int(d, "d")
        rng = check_rng(rng)
        self.weight = self.add_parameter(
            "weight", init_array(dense_init(rng, c_in, d, init), dtype, device))
        self.bias = self.add_parameter("bias", init_array(np.zeros(d), dtype, device))

    def forward(self, x):
        return local_linear_forward(x, self.weight.value, self.bias.value)

    def backward(self, ctx, d_y):
        grads = local_linear_backward(ctx, d_y)
        self.weight.accumulate(grads.weight)
        self.bias.accumulate(grads.bias)
        return grads.x
