r"""The cross-batch objectives on a model's two outputs ``(y, z)``: GSP + ZSR, and XML.

``GSPObjective`` (GSP Appendix C, Algorithm 1 with the ZSR of Algorithm 4)
    .. math::

        \mathcal{L} = (1 - \lambda)\, \mathcal{L}_{DML}(y) + \lambda\, \mathcal{L}_{ZSR}(z),

    ``L_DML`` any :class:`LossObjective` on the pooled embeddings ``y`` (B, d) and
    ``L_ZSR`` the zero-shot regulariser (:func:`refdml.crossbatch.zero_shot_loss_forward`)
    on the attribute histograms ``z`` (B, m), with learned class embeddings ``Upsilon``
    (a :class:`~refdml.train.Parameter` ``"<name>.class_embeddings"``, (n_classes,
    attribute_dim), drawn N(0, 1/attribute_dim)). The convex mixing is the paper's: Sec.
    4.3, supp. 1.6.7 and Algorithm 1 all print ``(1 - lambda) L_DML + lambda L_ZS`` with
    ``lambda = 0.1``; the shorthand ``L_DML + lambda L_ZSR`` is the same objective up
    to the factor ``1 - lambda`` on the learning rate of the DML term (see
    docs/corrections.md). Backward: ``d_y = (1 - lambda) dL_DML/dy``,
    ``d_z = lambda dL_ZSR/dz``; ``Upsilon`` receives ``lambda dL_ZSR/dUpsilon`` (as
    regression targets and as softmax weights) and the base's proxies ``(1 - lambda)``
    times theirs.
``XMLObjective`` (XML Eqs. 2.10-2.11)
    .. math::

        \mathcal{L} = (1 - \lambda)\, \ell(Y) + \lambda\, (\ell(\hat Y_1) + \ell(\hat Y_2)),
        \qquad \hat Y_1 = Z_1 V_2,\ \hat Y_2 = Z_2 V_1,

    on ``(y, z)`` = (GAP embeddings ``Y``, histograms ``Z``) through
    :func:`refdml.crossbatch.xml_loss_forward`. The base loss ``ell`` is a loss without
    proxies (its value on the cross-batch predictions has no proxy gradient to return).

Both draw the class-disjoint split of each batch from their own generator ``rng`` (one
draw per forward, on the host, the same for the fast path and the reference); its state
is in :meth:`state_dict` so a resumed run draws the same splits. ``forward(...,
split=mask)`` fixes the halves instead (tests, reproductions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from refdml._validation import _describe, check_choice, check_rng, check_scalar
from refdml._backend import get_backend
from refdml.train._layer import init_array
from refdml.train._operators import check_reference, operators
from refdml.crossbatch import class_disjoint_split
from refdml.gpu.crossbatch import zero_shot_staged_uploads
from refdml.train.objectives._base import (
    Objective,
    check_d_value,
    check_positive_int,
    host_labels,
    labels_on_device,
    load_rng_state,
    output_value,
    rng_state,
)
from refdml.train.objectives._loss import (
    LOSSES,
    PROXY_LOSSES,
    LossObjective,
    check_hyperparameters,
    split_outputs,
)

__all__ = ["GSPObjective", "XMLObjective"]


def _base_kwargs(base_kwargs) -> dict:
    if base_kwargs is None:
        return {}
    if not isinstance(base_kwargs, Mapping):
        raise TypeError(f"base_kwargs must be a mapping, got {_describe(base_kwargs)}")
    return dict(base_kwargs)


class GSPObjective(Objective):
    """GSP Algorithm 1: ``(1 - lambda_) L_DML(y) + lambda_ L_ZSR(z)`` (see the module doc).

    Parameters
    ----------
    base : str or LossObjective
        The DML loss on ``y``: a name of :data:`~refdml.train.objectives.LOSSES` (built as
        ``LossObjective(base, reference=reference, rng=rng, dtype=, device=,
        **base_kwargs)``; a proxy loss needs ``n_classes`` (taken from here) and ``dim`` in
        ``base_kwargs``) or a ready :class:`LossObjective`.
    lambda_ : float in [0, 1]
        Mixing weight (GSP: 0.1; supp. 2.2's collage study: 0.5).
    ridge : float > 0
        The paper's ϵ (epsilon) of (P3) (0.05).
    scale : float > 0
        Softmax scale of the ZSR (9.5, the authors' code; Algorithm 4 prints none).
    n_classes, attribute_dim : int
        Rows and width of the class embeddings ``Upsilon``; labels lie in ``0..n_classes-1``.
    reference : bool
        Run :mod:`refdml.crossbatch` / :mod:`refdml.losses` instead of the mirrors.
    rng : None, int or Generator
        Draws ``Upsilon``, the base's proxies, then each batch's split.
    """

    def __init__(self, base, *, lambda_: float = 0.1, ridge: float = 0.05, scale: float = 9.5,
                 n_classes: int, attribute_dim: int, reference: bool = False, rng=None,
                 base_kwargs=None, dtype=np.float64, device: str = "cpu",
                 name: str = "gsp_zsr") -> None:
        super().__init__(name)
        self.reference = check_reference(reference)
        self.lambda_ = check_scalar(lambda_, "lambda_", low=0.0, high=1.0)
        self.ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
        self.scale = check_scalar(scale, "scale", low=0.0, low_inclusive=False)
        n_classes = check_positive_int(n_classes, "n_classes")
        attribute_dim = check_positive_int(attribute_dim, "attribute_dim")
        self.rng = check_rng(rng)
        if isinstance(base, LossObjective):
            if base_kwargs is not None:
                raise ValueError("base_kwargs is for a base given by name; this base is built")
            self.base = base
        elif isinstance(base, str):
            check_choice(base, "base", LOSSES)
            kwargs = _base_kwargs(base_kwargs)
            if base in PROXY_LOSSES:
                kwargs.setdefault("n_classes", n_classes)
            self.base = LossObjective(base, reference=self.reference, rng=self.rng, dtype=dtype,
                                      device=device, name=f"{name}.base", **kwargs)
        else:
            raise TypeError(f"base must be a loss name or a LossObjective, got {_describe(base)}")
        values = self.rng.standard_normal((n_classes, attribute_dim)) / np.sqrt(attribute_dim)
        self.class_embeddings = self.add_parameter(
            "class_embeddings", init_array(values, dtype, device))

    def parameters(self):
        yield from self.base.parameters()
        yield from super().parameters()

    def state_dict(self) -> dict:
        return rng_state(self.rng)

    def load_state_dict(self, state: dict) -> None:
        load_rng_state(self.rng, state, self.name)

    def host_draws(self, labels) -> dict:
        """What :meth:`forward` would draw on the host for these (host) ``labels``, drawn now
        from the same generator in the same way: ``{"split": mask}`` (nothing with
        ``lambda_ == 0``). A captured training step draws it before the step and passes it
        to :meth:`forward` (a replayed graph runs no Python, so nothing may be drawn inside
        the step); an uncaptured step that passes it trains exactly as one that does not."""
        if self.lambda_ == 0.0:
            return {}
        return {"split": class_disjoint_split(host_labels(labels), rng=self.rng)}

    def staged_uploads(self, labels, *, split=None) -> dict:
        """``{key: host array}`` of what :meth:`forward` uploads for host ``labels`` and the
        drawn ``split`` (:meth:`host_draws`): the zero-shot operator's labels and split
        index (the base loss's labels are the loop's own ``"labels"``). A captured step puts
        them into fixed device buffers before its captured region
        (:func:`refdml._deferred.staged_upload`)."""
        if self.lambda_ == 0.0 or split is None or self.reference:
            return {}
        return zero_shot_staged_uploads(host_labels(labels), split)

    def forward(self, outputs, labels, *, split=None):
        """``(value, ctx)``; ``split`` (bool (B,), class-disjoint) fixes the ZSR halves."""
        y, z = split_outputs(outputs, self.name, pair=True)
        given, labels = labels, labels_on_device(labels, y)
        value, dml_ctx, zsr_ctx = None, None, None
        if self.lambda_ < 1.0:
            dml_value, dml_ctx = self.base.loss_forward(y, labels)
            value = (1.0 - self.lambda_) * dml_value
        if self.lambda_ > 0.0:
            # The split is drawn here on the host labels (free when the caller gave host
            # labels), as the operator would draw it from the same generator; the operator
            # takes the host labels too, so that neither reads the device.
            on_host = host_labels(given)
            if split is None:
                split = class_disjoint_split(on_host, rng=self.rng)
            zsr_value, zsr_ctx = operators(self.reference).zero_shot_loss.forward(
                z, on_host, self.class_embeddings.value, ridge=self.ridge, scale=self.scale,
                split=split, rng=self.rng)
            zsr_value = self.lambda_ * zsr_value
            value = zsr_value if value is None else value + zsr_value
        return output_value(value, y), self._context(
            (dml_ctx, zsr_ctx), self.reference, (tuple(y.shape), tuple(z.shape)))

    def backward(self, ctx, d_value=1.0):
        """``(d_y, d_z)``; adds into ``Upsilon``'s (and the base's proxies') ``.grad``."""
        ctx = self._unwrap(ctx)
        d_value = check_d_value(d_value)
        dml_ctx, zsr_ctx = ctx.inner
        y_shape, z_shape = ctx.output_shapes
        # lambda_ = 1 skips the DML term, lambda_ = 0 the ZSR: its output gets zeros.
        d_y = None
        if dml_ctx is not None:
            d_y = self.base.loss_backward(dml_ctx, (1.0 - self.lambda_) * d_value)
        if zsr_ctx is None:
            return d_y, _zeros_like_shape(d_y, z_shape)
        grads = operators(ctx.reference).zero_shot_loss.backward(zsr_ctx, self.lambda_ * d_value)
        self.class_embeddings.accumulate(grads.class_embeddings)
        if d_y is None:
            d_y = _zeros_like_shape(grads.Z, y_shape)
        return d_y, grads.Z


def _zeros_like_shape(like, shape):
    """Zeros of ``shape`` in the module and dtype of ``like``."""
    return get_backend(like).xp.zeros(shape, dtype=like.dtype)


class XMLObjective(Objective):
    """The XML loss (Eqs. 2.10-2.11) on ``(y, z)``: see the module doc.

    Parameters
    ----------
    base : str or callable
        A loss without proxies (``"contrastive"`` (default), ``"generalized_contrastive"``,
        ``"triplet"``, ``"multi_similarity"``) or a one-call ``value, grads =
        base(embeddings, labels, **base_kwargs)``.
    lambda_ : float in [0, 1]
        The ``lambda`` of Eq. (2.11) (1: the cross-batch term alone).
    ridge : float > 0
        The paper's ϵ (epsilon) of Eq. (2.8).
    base_kwargs : mapping
        Hyperparameters of the base loss.
    reference, rng
        As in :class:`GSPObjective` (``rng`` draws the splits). No parameters of its own.
    """

    def __init__(self, base="contrastive", *, lambda_: float, ridge: float,
                 reference: bool = False, rng=None, base_kwargs=None,
                 name: str = "xml") -> None:
        super().__init__(name)
        self.reference = check_reference(reference)
        self.lambda_ = check_scalar(lambda_, "lambda_", low=0.0, high=1.0)
        self.ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
        self.base_kwargs = _base_kwargs(base_kwargs)
        self.rng = check_rng(rng)
        if isinstance(base, str):
            if base in PROXY_LOSSES:
                raise ValueError(f"base == {base!r}: XML's base loss must be a loss without "
                                 "proxies (the cross-batch predictions give no proxy gradient)")
            check_choice(base, "base", tuple(n for n in LOSSES if n not in PROXY_LOSSES))
            self.base_loss: Callable = operators(self.reference).one_call_loss(base)
            check_hyperparameters(self.base_loss, self.base_kwargs, base)
        elif callable(base) and not isinstance(base, type):
            self.base_loss = base
        else:
            raise TypeError(f"base must be a loss name or a callable, got {_describe(base)}")

    def state_dict(self) -> dict:
        return rng_state(self.rng)

    def load_state_dict(self, state: dict) -> None:
        load_rng_state(self.rng, state, self.name)

    def forward(self, outputs, labels, *, split=None):
        """``(value, ctx)``; ``split`` (bool (B,), class-disjoint) fixes the halves."""
        y, z = split_outputs(outputs, self.name, pair=True)
        value, inner = operators(self.reference).xml_loss.forward(
            z, y, labels_on_device(labels, y), ridge=self.ridge, base_loss=self.base_loss,
            base_loss_kwargs=self.base_kwargs, split=split, rng=self.rng, lambda_=self.lambda_)
        return value, self._context(inner, self.reference, (tuple(y.shape), tuple(z.shape)))

    def backward(self, ctx, d_value=1.0):
        """``(d_y, d_z)`` of ``d_value * value``."""
        ctx = self._unwrap(ctx)
        grads = operators(ctx.reference).xml_loss.backward(
            ctx.inner, check_d_value(d_value))
        return grads.Y, grads.Z
