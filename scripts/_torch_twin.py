"""A PyTorch twin of a refdml training model: the yardstick of scripts/bench_train.py.

:func:`torch_twin` builds, from a refdml ``Sequential``, its objective and its Adam, the
same model in PyTorch with the same parameter values: convolutions, ReLU, the per-location
linear map, linear layers, the token table and the L2 normalisation are PyTorch's own
modules and functions, differentiated by autograd; the step is ``torch.optim.Adam``.
Two pieces have no PyTorch counterpart and enter as custom autograd functions around the
refdml objects themselves, as a PyTorch user of these papers would bring them in: the
GSP head (its (P2) solve and its closed-form backward, :mod:`refdml.gpu.gsp`) and the
objective (the base loss and the zero-shot regulariser). They therefore cost the same
on both sides, and the comparison measures everything else: the convolutions, the dense
layers, the optimiser and the per-layer overhead.

``gsp_head`` and ``objective_loss`` replace those two custom functions by torch code
(scripts/_torch_anchors.py's ``collage_twin``: the whole step in PyTorch, on any
``device``); the defaults run on the CPU only (they hand NumPy arrays to refdml).

Needs ``torch`` (not a dependency of refdml; the benchmark skips its rows without it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from refdml.train.layers import (
    Conv2d,
    Embedding,
    GSPHead,
    L2Normalize,
    Linear,
    LocalLinear,
    ReLU,
)

__all__ = ["TorchTwin", "torch_twin"]


def _tensor(array) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


class _GSPHeadFunction(torch.autograd.Function):
    """The refdml GSP head (its own forward and backward) inside autograd."""

    @staticmethod
    def forward(ctx, head, x, prototypes):
        head.prototypes.value = prototypes.detach().numpy()
        (pooled, z), head_ctx = head.forward(x.detach().numpy())
        ctx.head, ctx.head_ctx = head, head_ctx
        return _tensor(pooled), _tensor(z)

    @staticmethod
    def backward(ctx, d_pooled, d_z):
        head = ctx.head
        head.prototypes.zero_grad()
        d_x = head.backward(ctx.head_ctx, (d_pooled.numpy(), d_z.numpy()))
        # A copy: the head zeroes its grad in place at the next backward, and autograd may
        # keep this tensor as the PyTorch parameter's .grad.
        return None, _tensor(d_x), _tensor(head.prototypes.grad.copy())


class _ObjectiveFunction(torch.autograd.Function):
    """The refdml objective of ``(embeddings, *side outputs)`` inside autograd."""

    @staticmethod
    def forward(ctx, objective, labels, n_outputs, *tensors):
        outputs, params = tensors[:n_outputs], tensors[n_outputs:]
        for param, value in zip(objective.parameters(), params):
            param.value = value.detach().numpy()
        arrays = tuple(t.detach().numpy() for t in outputs)
        value, objective_ctx = objective.forward(arrays if n_outputs > 1 else arrays[0], labels)
        ctx.objective, ctx.objective_ctx, ctx.n_outputs = objective, objective_ctx, n_outputs
        return torch.tensor(float(value), dtype=outputs[0].dtype)

    @staticmethod
    def backward(ctx, d_value):
        objective = ctx.objective
        for param in objective.parameters():
            param.zero_grad()
        d_out = objective.backward(ctx.objective_ctx, float(d_value))
        d_out = d_out if ctx.n_outputs > 1 else (d_out,)
        d_outputs = [None if d is None else _tensor(d) for d in d_out]
        d_params = [_tensor(p.grad.copy()) for p in objective.parameters()]   # as above
        return (None, None, None, *d_outputs, *d_params)


class TorchTwin:
    """The PyTorch model, objective and Adam of :func:`torch_twin`; ``step()`` trains once.

    ``named_parameters`` maps refdml's parameter names to the PyTorch tensors.
    ``gsp_head(layer, x, prototypes) -> (pooled, z)`` and ``objective_loss(outputs,
    parameters) -> loss`` (``parameters``: the objective's tensors by refdml name) replace
    the custom functions around refdml's GSP head and objective; ``device`` and ``dtype``
    (a floating torch dtype; default: as refdml's arrays) place the parameters and ``x``.
    """

    def __init__(self, model, objective, optimizer, x, labels, *, device="cpu", dtype=None,
                 gsp_head=None, objective_loss=None) -> None:
        def parameter(value):
            return torch.nn.Parameter(torch.tensor(np.array(value), device=device, dtype=dtype))

        self._gsp_head = gsp_head if gsp_head is not None else _GSPHeadFunction.apply
        self._objective_loss = objective_loss
        self._layers = []
        self.named_parameters: dict[str, torch.nn.Parameter] = {}
        for layer in model.layers:
            params = {}
            for name, param in layer.named_parameters():
                tensor = parameter(param.value)
                params[name.rsplit(".", 1)[1]] = tensor
                self.named_parameters[name] = tensor
            self._layers.append((layer, params))
        self._objective = objective
        self._objective_params = []
        self._objective_names = []
        for name, param in objective.named_parameters():
            tensor = parameter(param.value)
            self._objective_params.append(tensor)
            self._objective_names.append(name)
            self.named_parameters[name] = tensor
        self.optimizer = torch.optim.Adam(
            list(self.named_parameters.values()), lr=optimizer.lr, betas=optimizer.betas,
            eps=optimizer.eps, weight_decay=optimizer.weight_decay)
        x = np.array(x)
        self.x = torch.as_tensor(x, device=device,
                                 dtype=dtype if np.issubdtype(x.dtype, np.floating) else None)
        self.labels = np.array(labels)

    def forward(self, x):
        sides = []
        for layer, p in self._layers:
            if isinstance(layer, Conv2d):
                x = F.conv2d(x, p["weight"], p["bias"], stride=layer.stride,
                             padding=layer.padding)
            elif isinstance(layer, ReLU):
                x = F.relu(x)
            elif isinstance(layer, LocalLinear):
                x = F.linear(x.flatten(2).transpose(1, 2), p["weight"], p["bias"])
            elif isinstance(layer, Linear):
                x = F.linear(x, p["weight"], p["bias"])
            elif isinstance(layer, Embedding):
                x = F.embedding(x, p["table"])
            elif isinstance(layer, L2Normalize):
                x = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            elif isinstance(layer, GSPHead):
                x, z = self._gsp_head(layer, x, p["prototypes"])
                sides.append(z)
            else:
                raise TypeError(f"no PyTorch twin for layer {layer!r}")
        return (x, *sides)

    def loss(self):
        outputs = self.forward(self.x)
        if self._objective_loss is not None:
            return self._objective_loss(outputs, dict(zip(self._objective_names,
                                                          self._objective_params)))
        return _ObjectiveFunction.apply(self._objective, self.labels, len(outputs), *outputs,
                                        *self._objective_params)

    def step(self) -> None:
        """``zero_grad``, forward, loss, backward, Adam step: one training step."""
        self.optimizer.zero_grad()
        self.loss().backward()
        self.optimizer.step()


def torch_twin(model, objective, optimizer, x, labels, **options) -> TorchTwin:
    """The PyTorch twin of a refdml ``Sequential`` ``model``, ``objective`` and Adam
    ``optimizer`` on the batch ``(x, labels)`` (NumPy), with copies of their parameter
    values. ``model`` and ``objective`` must be objects of their own: the twin runs the GSP
    head and the objective through them, and sets their parameters to its own tensors.
    ``options``: :class:`TorchTwin`'s keywords (``device``, ``dtype``, ``gsp_head``,
    ``objective_loss``).
    """
    return TorchTwin(model, objective, optimizer, x, labels, **options)
