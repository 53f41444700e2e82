r"""``ASAPObjective``: ASAP Algorithms 1 and 2 (proxy DML with a projection regulariser).

Each "problem instance" ``k`` of ASAP Alg. 1 solves Eq. (4.11)

.. math::

    \min_{\theta, \rho}\ \frac{\lambda}{2} \|\theta - \theta^*\|_2^2
        + \frac{1}{m |\rho|} \sum_{\rho \times [m]} \ell(\rho_i, z_j; \theta),

where (derived from Sec. 4.3 and Alg. 1):

* ``theta`` are the parameters of the embedding function ``f(.; theta)``, i.e. the MODEL's
  parameters (Sec. 3 defines ``theta`` as such; Eq. 4.9 projects ``theta^(k-1)`` onto
  ``C_{s_k}``), passed as ``model_parameters``;
* ``theta*`` is ``theta`` at the start of the instance (Alg. 1: ``theta* <- theta`` when an
  instance has converged, and the next instance's proxies are chosen with
  ``f(.; theta*)``), recorded by :meth:`ASAPObjective.new_problem_instance` (and at
  construction, Alg. 1's "initialize theta* randomly" being the model's initialisation);
* the proxies ``rho`` are NOT regularised: Alg. 1's ``g_rho`` is the loss gradient alone;
  they are re-initialised at each instance instead.

The loss ``ell`` (``base``), with several proxies per class, through :class:`LossObjective`:

* ``"contrastive"`` and ``"multi_similarity"``: the pair loss of that name between every
  proxy and every batch sample (:func:`refdml.losses.proxy_contrastive`,
  :func:`refdml.losses.proxy_multi_similarity`), as the paper runs ASAP: C2-ASAP (and
  C1-ASAP with ``form="cosine"``) and MS-ASAP of Sec. 5.1 and Table 1; ``"mean"``
  averages the contrastive terms over the ``m |rho|`` pairs, Eq. (4.11)'s
  ``1 / (m |rho|)``;
* ``"proxy_nca"`` and ``"proxy_anchor"``: proxy losses, which the paper does not pair ASAP
  with; the pairing is this project's own question.

The loss's own hyperparameters (``pos_margin``, ``neg_margin``, ``form``, ``alpha``,
``beta``, ``base``, ``temperature``, ...) pass through to it. The
regulariser's gradient ``lambda (theta - theta*)`` is ADDED into each model parameter's
``.grad`` by :meth:`backward` (times ``d_value``), besides the proxies' loss gradient;
Alg. 1 prints ``g_theta <- lambda (theta* - theta) + ...``, the negative of the gradient
of ``lambda/2 ||theta - theta*||^2`` (docs/corrections.md).

:meth:`ASAPObjective.new_problem_instance` is ASAP Alg. 2 (Greedy K-Center Proxy,
:func:`refdml.kcenter.select_proxies`): for each class, a pool of ``budget`` samples of
the given embeddings (computed by the caller with the current model, i.e. ``f(.;
theta*)``), of which ``proxies_per_class`` are picked farthest-first from the class's
current proxies; they replace the proxies in place. A trainer should also reset the
optimiser's state of the proxies there (their moments belong to the old proxies).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from refdml._validation import (
    _describe,
    as_float_array,
    as_label_array,
    check_choice,
    check_rng,
    check_scalar,
)
from refdml._backend import get_backend, is_array, to_numpy
from refdml.kcenter import select_proxies
from refdml.train._parameter import Parameter
from refdml.train.objectives._base import (Objective, check_d_value, check_positive_int,
                                           labels_on_device)
from refdml.train.objectives._loss import (SAMPLE_PROXY_LOSSES, LossObjective,
                                            split_outputs)

__all__ = ["ASAPObjective"]

#: The bases: the paper's pair losses (between samples and proxies), then the proxy losses.
BASES = ("contrastive", "multi_similarity", "proxy_nca", "proxy_anchor")


class ASAPObjective(Objective):
    """A multi-proxy loss plus ``lambda_/2 ||theta - theta*||^2`` (see the module doc).

    Parameters
    ----------
    base : ``"contrastive"``, ``"multi_similarity"``, ``"proxy_nca"`` or ``"proxy_anchor"``
        The loss between proxies and samples (module doc); a pair loss runs as its
        sample-proxy form, ``base.loss_name`` ``"proxy_contrastive"`` say.
    n_classes, dim : int
        Classes and embedding dimension of the proxies.
    proxies_per_class : int
        ASAP App. A.2: 8 (CUB, Cars), 4 (In-shop, SOP).
    budget : int >= proxies_per_class
        The pool size ``b`` of Alg. 2 (12 or 7 in App. A.2).
    lambda_ : float >= 0
        Projection regularisation weight (2e-4 in App. A.2).
    model_parameters : iterable of Parameter
        ``theta``: the model's parameters the regulariser applies to (may be empty).
    reference, rng, dtype, device, **hyperparameters
        As in :class:`LossObjective` (``rng`` draws the initial proxies).
    """

    def __init__(self, base: str = "proxy_nca", *, n_classes: int, dim: int,
                 proxies_per_class: int, budget: int, lambda_: float,
                 model_parameters: Iterable[Parameter] = (), reference: bool = False,
                 rng=None, dtype=np.float64, device: str = "cpu", name: str = "asap",
                 **hyperparameters) -> None:
        super().__init__(name)
        loss = SAMPLE_PROXY_LOSSES.get(check_choice(base, "base", BASES), base)
        self.proxies_per_class = check_positive_int(proxies_per_class, "proxies_per_class")
        self.budget = check_positive_int(budget, "budget")
        if self.budget < self.proxies_per_class:
            raise ValueError(f"budget == {self.budget}, must be >= proxies_per_class == "
                             f"{self.proxies_per_class} (Alg. 2 picks that many from the pool)")
        self.lambda_ = check_scalar(lambda_, "lambda_", low=0.0)
        if isinstance(model_parameters, (Parameter, str, bytes)) or not isinstance(
                model_parameters, Iterable):
            raise TypeError("model_parameters must be an iterable of Parameter objects (e.g. "
                            f"model.parameters()), got {_describe(model_parameters)}")
        self.model_parameters = list(model_parameters)
        for parameter in self.model_parameters:
            if not isinstance(parameter, Parameter):
                raise TypeError(
                    f"model_parameters must hold Parameter objects, got {_describe(parameter)}")
        self.base = LossObjective(loss, reference=reference, n_classes=n_classes, dim=dim,
                                  proxies_per_class=self.proxies_per_class, rng=rng,
                                  dtype=dtype, device=device, name=f"{name}.base",
                                  **hyperparameters)
        self.reference = self.base.reference
        self.proxies = self.base.proxies
        self.proxy_labels = self.base.proxy_labels
        self.theta_star = [p.value.copy() for p in self.model_parameters]

    def parameters(self):
        yield from self.base.parameters()

    def state_dict(self) -> dict:
        """``theta*`` (NumPy copies, in the order of ``model_parameters``)."""
        return {"theta_star": [to_numpy(t).copy() for t in self.theta_star]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "theta_star" not in state:
            raise ValueError(f"state for {self.name} must be a dict with the key 'theta_star'")
        if not isinstance(state["theta_star"], (list, tuple)):
            raise TypeError(f"state['theta_star'] must be a list of arrays, got "
                            f"{_describe(state['theta_star'])}")
        values = list(state["theta_star"])
        if len(values) != len(self.model_parameters):
            raise ValueError(f"state holds {len(values)} theta* arrays, the objective has "
                             f"{len(self.model_parameters)} model parameters")
        restored = []
        for parameter, value in zip(self.model_parameters, values):
            value = as_float_array(to_numpy(value) if is_array(value) else value,
                                   f"theta* for {parameter.name}", allow_empty=True)
            if value.shape != parameter.shape:
                raise ValueError(f"theta* for {parameter.name} has shape {value.shape}, "
                                 f"must be {parameter.shape}")
            xp = get_backend(parameter.value).xp
            restored.append(xp.asarray(value, dtype=parameter.value.dtype))
        self.theta_star = restored

    def regularizer(self) -> tuple[float, list]:
        """``lambda_/2 sum ||theta - theta*||^2`` and the differences ``theta - theta*``."""
        differences = [p.value - t for p, t in zip(self.model_parameters, self.theta_star)]
        value = 0.5 * self.lambda_ * sum(float((d * d).sum()) for d in differences)
        return value, differences

    def forward(self, outputs, labels):
        """``(loss + regulariser, ctx)`` on ``y`` (``outputs`` is ``y`` or ``(y, z)``)."""
        y, z = split_outputs(outputs, self.name)
        loss_value, inner = self.base.loss_forward(y, labels_on_device(labels, y))
        reg_value, differences = self.regularizer() if self.lambda_ > 0.0 else (0.0, [])
        shapes = (tuple(y.shape),) if z is None else (tuple(y.shape), tuple(z.shape))
        return loss_value + reg_value, self._context(inner, self.reference, shapes,
                                                     extra=differences)

    def backward(self, ctx, d_value=1.0):
        """``d_y``; adds the proxies' gradient and ``d_value lambda_ (theta - theta*)``
        into each model parameter's ``.grad``."""
        ctx = self._unwrap(ctx)
        d_value = check_d_value(d_value)
        d_y = self.base.loss_backward(ctx.inner, d_value)
        for parameter, difference in zip(self.model_parameters, ctx.extra):
            parameter.accumulate((d_value * self.lambda_) * difference)
        return d_y if len(ctx.output_shapes) == 1 else (d_y, None)

    def _host_pool(self, embeddings, labels) -> tuple[np.ndarray, np.ndarray]:
        """Embeddings (N, dim) as float64 and labels (N,) as int64 on the host, checked
        (real, finite, the proxies' ``dim``; before any cast, so a complex or boolean
        array is refused rather than converted)."""
        embeddings = as_float_array(to_numpy(embeddings) if is_array(embeddings)
                                    else embeddings, "embeddings", ndim=2)
        dim = self.proxies.shape[1]
        if embeddings.shape[1] != dim:
            raise ValueError(f"embeddings has shape {embeddings.shape}, its rows must have the "
                             f"proxies' dimension {dim}")
        labels = as_label_array(to_numpy(labels) if is_array(labels) else labels,
                                "labels", length=embeddings.shape[0])
        return embeddings, labels

    def covering_radius(self, embeddings, labels) -> float:
        """``max_i min_{p: class(p) = y_i} ||e_i - p / ||p|| ||``: the largest distance of a
        sample to its nearest own-class proxy (ASAP Prop. 4.2 / App. proof: the radius of
        the smallest balls around the class proxies covering the class's samples), with
        the proxies L2-normalised (every base compares unit rows). ``embeddings``
        (N, dim) as the trainer's ``embed`` gives them (L2-normalised). Host, float64.
        """
        e, y = self._host_pool(embeddings, labels)
        p = to_numpy(self.proxies.value).astype(np.float64)
        p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), np.finfo(np.float64).tiny)
        # Distances in units of the largest |entry| (a power of two: exact), so that squares
        # neither overflow nor underflow whatever the embeddings' scale.
        unit = float(2.0 ** np.ceil(np.log2(max(float(np.abs(e).max(initial=0.0)), 1.0))))
        e, p = e / unit, p / unit
        proxy_labels = np.asarray(to_numpy(self.proxy_labels))
        radius = 0.0
        for c in np.unique(y):
            own = p[proxy_labels == c]
            if own.shape[0] == 0:
                raise ValueError(f"class {c} has no proxy")
            x = e[y == c]
            d2 = ((x[:, None, :] - own[None, :, :]) ** 2).sum(axis=2)
            radius = max(radius, float(np.sqrt(d2.min(axis=1).max())))
        return radius * unit

    def new_problem_instance(self, embeddings, labels, rng=None):
        """ASAP Alg. 1's outer step: ``theta* <- theta``, proxies by Alg. 2.

        ``embeddings`` (N, dim) and ``labels`` (N,) of a pool of training samples, embedded
        by the current model (``f(.; theta*)``); every class needs at least
        ``proxies_per_class`` samples. ``rng`` draws the per-class pools of ``budget``.
        Returns the :class:`~refdml.kcenter.ProxySelection` (indices into ``embeddings``).
        The selection runs on the host in float64 (it is ``select_proxies`` itself).
        """
        embeddings, labels = self._host_pool(embeddings, labels)
        rng = check_rng(rng)
        selection = select_proxies(
            embeddings, labels,
            to_numpy(self.proxies.value).astype(np.float64), to_numpy(self.proxy_labels),
            budget=self.budget, rng=rng)
        xp = get_backend(self.proxies.value).xp
        self.proxies.value[...] = xp.asarray(selection.proxies, dtype=self.proxies.value.dtype)
        self.theta_star = [p.value.copy() for p in self.model_parameters]
        return selection
