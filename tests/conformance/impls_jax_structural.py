"""Structural defects for the low-precision tests: one wrong term, in JAX, per operator.

Each is a correct JAX implementation (from :mod:`impls_jax_losses`, :mod:`impls_jax`, or
Proxy-Anchor below, written from Kim et al. 2020, Eq. 4 and refdml's docstring) with one
defect of the kind a person writes and a float32 test catches, and that bfloat16's
8-bit significand must not hide on ordinary inputs:

===================================  ======================  ===========================
function                             operator                defect
===================================  ======================  ===========================
``proxy_nca_no_positive_in_denom``   ``losses.proxy_nca``     a missing denominator term
``contrastive_sum_for_mean``         ``losses.contrastive``   a wrong reduction
``gsp_pool_without_epsilon``         ``gsp.pool``             a missing epsilon
``proxy_anchor_unnormalised``        ``losses.proxy_anchor``  a dropped normalisation
``triplet_margin_sign``              ``losses.triplet``       a sign error
===================================  ======================  ===========================
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import impls_jax as gsp_ot
import impls_jax_losses as losses

__all__ = ["contrastive_sum_for_mean", "gsp_pool_without_epsilon", "proxy_anchor",
           "proxy_anchor_unnormalised", "proxy_nca_no_positive_in_denom",
           "triplet_margin_sign"]


# ------------------------------------------------------------------ ProxyNCA++ (Eq. 5)


@jax.jit
def _proxy_nca_negatives_only(x, proxies, same, temperature):
    similarity = losses._unit_rows(x) @ losses._unit_rows(proxies).T
    logits = -(2.0 - 2.0 * similarity) / temperature
    own_class = jax.nn.logsumexp(jnp.where(same, logits, -jnp.inf), axis=1)
    others = jax.nn.logsumexp(jnp.where(same, -jnp.inf, logits), axis=1)
    return jnp.mean(others - own_class)


def proxy_nca_no_positive_in_denom(embeddings, labels, *, proxies, proxy_labels=None,
                                   temperature=0.11, reduction="mean"):
    """DEFECT: the denominator sums over the other classes' proxies only (ProxyNCA's
    form, not ProxyNCA++'s): ``-log(sum_own exp z / sum_others exp z)``."""
    labels = np.asarray(labels)
    proxy_labels = (np.arange(proxies.shape[0]) if proxy_labels is None
                    else np.asarray(proxy_labels))
    return _proxy_nca_negatives_only(embeddings, proxies,
                                     labels[:, None] == proxy_labels[None, :], temperature)


# ------------------------------------------------------------------------ contrastive


def contrastive_sum_for_mean(embeddings, labels, *, pos_margin=None, neg_margin=None,
                             form="euclidean", reduction="mean"):
    """DEFECT: ``"mean"`` asked, the terms summed."""
    return losses.contrastive(embeddings, labels, pos_margin=pos_margin,
                              neg_margin=neg_margin, form=form, reduction="sum")


# --------------------------------------------------------------------------- GSP pool


def gsp_pool_without_epsilon(features, prototypes, *, mu, inverse_temperature, p=1.0,
                             method=None, max_iter=None, tol=None, backward=None):
    """DEFECT: the transport's exponent ``-eps c`` written ``-c`` (eps left out)."""
    return gsp_ot.gsp_pool(features, prototypes, mu=mu, inverse_temperature=1.0, p=p)


# ---------------------------------------------------------------- Proxy-Anchor (Eq. 4)


@functools.partial(jax.jit, static_argnames=("normalise",))
def _proxy_anchor_core(x, proxies, same, alpha, delta, *, normalise):
    if normalise:
        similarity = losses._unit_rows(x) @ losses._unit_rows(proxies).T
    else:
        similarity = x @ proxies.T
    # log(1 + sum exp(t)) over a masked set, as a log-sum-exp with the 0 of the "1".
    def log1p_sum_exp(t, mask):
        t = jnp.where(mask, t, -jnp.inf)
        return jax.nn.logsumexp(jnp.concatenate([t, jnp.zeros((1, t.shape[1]), t.dtype)]),
                                axis=0)

    positive = log1p_sum_exp(-alpha * (similarity - delta), same)
    negative = log1p_sum_exp(alpha * (similarity + delta), ~same)
    with_positive = jnp.any(same, axis=0)
    return (jnp.sum(jnp.where(with_positive, positive, 0.0))
            / jnp.maximum(jnp.sum(with_positive), 1)
            + jnp.mean(negative))


def _proxy_anchor(embeddings, labels, proxies, proxy_labels, alpha, delta, normalise):
    labels = np.asarray(labels)
    proxy_labels = (np.arange(proxies.shape[0]) if proxy_labels is None
                    else np.asarray(proxy_labels))
    return _proxy_anchor_core(embeddings, proxies, labels[:, None] == proxy_labels[None, :],
                              alpha, delta, normalise=normalise)


def proxy_anchor(embeddings, labels, *, proxies, proxy_labels=None, delta=0.1, alpha=32.0,
                 reduction="mean"):
    """Proxy-Anchor on cosine similarities: the positive log(1 + sum exp) averaged over the
    proxies with a positive in the batch, the negative one over all proxies."""
    if reduction != "mean":
        raise ValueError(f"reduction == {reduction!r}: only 'mean' is implemented")
    return _proxy_anchor(embeddings, labels, proxies, proxy_labels, alpha, delta, True)


def proxy_anchor_unnormalised(embeddings, labels, *, proxies, proxy_labels=None, delta=0.1,
                              alpha=32.0, reduction="mean"):
    """DEFECT: the rows are not L2-normalised: dot products in place of cosines."""
    return _proxy_anchor(embeddings, labels, proxies, proxy_labels, alpha, delta, False)


# ---------------------------------------------------------------------------- triplet


def triplet_margin_sign(embeddings, labels, *, margin=0.0961, mining="all",
                        reduction="mean"):
    """DEFECT: ``[d_ap - d_an - margin]_+``: the margin enters with the wrong sign."""
    return losses.triplet(embeddings, labels, margin=-margin, mining=mining,
                          reduction=reduction)
