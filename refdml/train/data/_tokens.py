r"""The GSP synthetic token study (GSP supplement Sec. 2.1; main paper Sec. 5.1, Fig. 3a).

What the paper says, and how it is read here
--------------------------------------------
"16-class problem ... Each class is defined with 4 distinct tokens and there are also 4
background tokens shared by all classes. We sample class representations from both class
specific and background tokens according to a mixing ratio :math:`\tilde\mu \sim
\mathcal N(0.5, 0.1)`. We sample a total of 50 tokens ... we first sample :math:`\mu = 0.4`
and then sample 20 tokens from :math:`\nu^{(c)}` with replacement, and 30 tokens from
:math:`\nu^{(b)}` ... We also constrain the range of the token vectors to be in between
[-0.3, 0.3] ... In each batch, we use 4 samples from 16 classes."

A sample of class ``c`` is therefore the multiset of token ids

.. math::

    \mu \sim \mathcal N(0.5,\ 0.1^2),\quad
    k = \operatorname{rint}(50\,\operatorname{clip}(\mu, 0, 1)),\quad
    f^{(c)} = \{\nu^{(c)}_{u_1}, \dots, \nu^{(c)}_{u_k},\ \nu^{(b)}_{v_1}, \dots, \nu^{(b)}_{v_{50-k}}\},

with :math:`u_i \sim \mathcal U\{1..4\}`, :math:`v_j \sim \mathcal U\{1..4\}` i.i.d. (with
replacement), i.e. ``mu`` is the **foreground** (class-token) share: the paper's worked
example has ``mu = 0.4`` giving 20 class tokens and 30 background tokens.

Decisions where the paper is silent (also in docs/corrections.md and docs/train_data.md):

- ``N(0.5, 0.1)``: 0.1 is read as the standard deviation (NumPy's convention; the worked
  example ``mu = 0.4`` is one such deviation from the mean). The variance reading would be
  std 0.316, giving ``mu`` outside [0, 1] for 11 % of the samples, which the paper would have
  had to mention.
- ``mu`` is clipped to [0, 1] (needed for a share; at std 0.1 a clip happens with
  probability 6e-7) and ``k = rint(50 mu)`` (round half to even: 0.4 -> 20 as in the
  example).
- The 50 positions are shuffled per sample (pooling is permutation-invariant; the shuffle
  keeps a position-dependent bug from hiding), and ``foreground`` marks the class tokens.
- "Tokens kept in [-0.3, 0.3]" constrains the **values of the trainable token embedding
  vectors** (the paper: "the range of the token vectors ... to bound the magnitude of the
  learned vectors"), not the data: :func:`init_token_table` draws the table uniformly in that
  range and :func:`clip_token_table` projects it back after every optimiser step.
- Vocabulary: class ``c``'s tokens have ids ``4c .. 4c+3`` (0 .. 63), the background tokens
  ids 64 .. 67, so ``n_tokens = 68`` rows in the embedding table.
- Splits: the classes *are* their trainable tokens, so an unseen class would have untrained
  tokens; the study's train / validation / test sets are independent draws over the same 16
  classes (the paper does not say how many samples; :func:`make_token_splits` takes counts).
- Batches of "4 samples from 16 classes" are :class:`~refdml.train.data.PKBatchSampler` with
  ``n_classes_per_batch=16, n_samples_per_class=4`` (see ``PAPER_BATCH``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import _describe, as_fast_array, check_float_dtype, check_rng, check_scalar
from refdml._backend import get_backend, is_array

__all__ = [
    "TOKEN_VALUE_RANGE",
    "PAPER_BATCH",
    "TokenSamples",
    "TokenSplits",
    "make_tokens",
    "make_token_splits",
    "init_token_table",
    "clip_token_table",
]

#: Range of every entry of the trainable token vectors (GSP supp. 2.1).
TOKEN_VALUE_RANGE = (-0.3, 0.3)
#: The paper's batch: 4 samples from each of 16 classes (P = 16 classes x K = 4 samples).
PAPER_BATCH = {"n_classes_per_batch": 16, "n_samples_per_class": 4}


@dataclass(frozen=True)
class TokenSamples:
    """Samples of the token study.

    token_ids : (N, tokens_per_sample) int64, rows of the token table.
    labels : (N,) int64 class of each sample, in ``0 .. n_classes - 1``.
    foreground : (N, tokens_per_sample) bool, True where the token is a class token
        (the experiment reports the pooling weight mass on the ``~foreground`` tokens).
    mixing_ratio : (N,) float64, the drawn ``mu`` after clipping to [0, 1].
    n_tokens : int, rows of the token table (``n_classes * tokens_per_class + n_background_tokens``).
    """

    token_ids: np.ndarray
    labels: np.ndarray
    foreground: np.ndarray
    mixing_ratio: np.ndarray
    n_tokens: int

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class TokenSplits:
    """Independent train / validation / test draws over the same classes."""

    train: TokenSamples
    val: TokenSamples
    test: TokenSamples


def make_tokens(
    n_per_class: int,
    *,
    rng: Any,
    n_classes: int = 16,
    tokens_per_class: int = 4,
    n_background_tokens: int = 4,
    tokens_per_sample: int = 50,
    mixing_mean: float = 0.5,
    mixing_std: float = 0.1,
) -> TokenSamples:
    """Draw ``n_per_class`` samples of each class of the GSP token study (see module doc).

    Samples are ordered class by class (``labels = repeat(arange(n_classes), n_per_class)``).
    The defaults are the paper's. Randomness only through ``rng`` (None, a seed or a Generator).
    """
    n_per_class = check_scalar(n_per_class, "n_per_class", low=1, integer=True)
    n_classes = check_scalar(n_classes, "n_classes", low=2, integer=True)
    tokens_per_class = check_scalar(tokens_per_class, "tokens_per_class", low=1, integer=True)
    n_background_tokens = check_scalar(n_background_tokens, "n_background_tokens", low=1, integer=True)
    n = check_scalar(tokens_per_sample, "tokens_per_sample", low=1, integer=True)
    mixing_mean = check_scalar(mixing_mean, "mixing_mean", low=0.0, high=1.0)
    mixing_std = check_scalar(mixing_std, "mixing_std", low=0.0)
    gen = check_rng(rng)
    # Sizes and token ids beyond int64: np.repeat's size wraps around (a segfault in NumPy
    # 2.4, not an error) and the ids would overflow.
    if n_classes * n_per_class * n >= 2**63:
        raise ValueError(f"{n_classes} classes x {n_per_class} samples per class x {n} "
                         f"tokens_per_sample == {n_classes * n_per_class * n} token slots, "
                         "must be < 2**63")
    if n_classes * tokens_per_class + n_background_tokens >= 2**63:
        raise ValueError(f"tokens_per_class == {tokens_per_class}: n_classes * "
                         "tokens_per_class + n_background_tokens token ids must be < 2**63")

    labels = np.repeat(np.arange(n_classes, dtype=np.int64), n_per_class)
    n_samples = labels.shape[0]
    mu = np.clip(gen.normal(mixing_mean, mixing_std, size=n_samples), 0.0, 1.0)
    n_foreground = np.rint(n * mu).astype(np.int64)
    # A uniformly random set of n_foreground[i] positions of row i: the ranks of i.i.d. keys.
    ranks = np.argsort(np.argsort(gen.random((n_samples, n)), axis=1), axis=1)
    foreground = ranks < n_foreground[:, None]
    class_pick = gen.integers(tokens_per_class, size=(n_samples, n))
    background_pick = gen.integers(n_background_tokens, size=(n_samples, n))
    first_background = n_classes * tokens_per_class
    token_ids = np.where(
        foreground,
        labels[:, None] * tokens_per_class + class_pick,
        first_background + background_pick,
    ).astype(np.int64)
    return TokenSamples(
        token_ids=token_ids,
        labels=labels,
        foreground=foreground,
        mixing_ratio=mu,
        n_tokens=first_background + n_background_tokens,
    )


def make_token_splits(
    *,
    rng: Any,
    n_train_per_class: int = 64,
    n_val_per_class: int = 16,
    n_test_per_class: int = 16,
    **study: Any,
) -> TokenSplits:
    """Three independent draws of :func:`make_tokens` (same classes, same tokens).

    The defaults (64 / 16 / 16 per class) are ours: 64 per class gives 16 of the paper's
    16 x 4 batches per epoch. ``study`` passes the study's shape (``n_classes`` ...) through
    (any keyword of :func:`make_tokens` but ``n_per_class`` and ``rng``).
    """
    # Checked here, under their own names, before make_tokens sees them as n_per_class.
    for name, value in (("n_train_per_class", n_train_per_class),
                        ("n_val_per_class", n_val_per_class),
                        ("n_test_per_class", n_test_per_class)):
        check_scalar(value, name, low=1, integer=True)
    allowed = ("n_classes", "tokens_per_class", "n_background_tokens", "tokens_per_sample",
               "mixing_mean", "mixing_std")
    for key in study:
        if key not in allowed:
            raise TypeError(f"make_token_splits got the keyword {key!r}; the study's keywords "
                            f"are {allowed}")
    gen = check_rng(rng)
    return TokenSplits(
        train=make_tokens(n_train_per_class, rng=gen, **study),
        val=make_tokens(n_val_per_class, rng=gen, **study),
        test=make_tokens(n_test_per_class, rng=gen, **study),
    )


def init_token_table(n_tokens: int, dim: int, *, rng: Any, dtype: Any = np.float64, xp: Any = np):
    """A ``(n_tokens, dim)`` token table drawn uniformly in :data:`TOKEN_VALUE_RANGE`.

    Drawn on the host with ``rng`` (so NumPy and CuPy runs start from the same table), then
    moved to ``xp`` (``numpy`` or ``cupy``) in ``dtype`` (float32 or float64).
    """
    n_tokens = check_scalar(n_tokens, "n_tokens", low=1, integer=True)
    dim = check_scalar(dim, "dim", low=1, integer=True)
    dtype = check_float_dtype(dtype, "dtype")
    if getattr(xp, "__name__", None) not in ("numpy", "cupy"):
        raise TypeError(f"xp must be the module numpy or cupy, got {_describe(xp)}")
    low, high = TOKEN_VALUE_RANGE
    table = check_rng(rng).uniform(low, high, size=(n_tokens, dim))
    return xp.asarray(table.astype(dtype))


def clip_token_table(table):
    """Project the token table onto :data:`TOKEN_VALUE_RANGE` in place (NumPy or CuPy); return it.

    Called after each optimiser step: the paper constrains the learned vectors to [-0.3, 0.3].
    ``table`` is the table itself (e.g. ``Embedding.table.value``): a writable float32 or
    float64 array (n_tokens, dim), else ``TypeError`` (a list or an integer array cannot be
    clipped in place). Its entries must be finite (``ValueError``): a NaN would stay NaN,
    and clipping an inf would hide a diverged step. On CuPy the finiteness check follows
    :func:`refdml.gpu.set_finite_checks` (it synchronises the device).
    """
    if not is_array(table):
        raise TypeError(f"table must be the token table, a NumPy or CuPy array clipped in "
                        f"place, got {_describe(table)}")
    if np.dtype(table.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"table must be float32 or float64 (it is clipped in place), got dtype "
                        f"{table.dtype}")
    if isinstance(table, np.ndarray) and not table.flags.writeable:
        raise ValueError("table is read-only; it is clipped in place")
    as_fast_array(table, "table", ndim=2)
    xp = get_backend(table).xp
    low, high = TOKEN_VALUE_RANGE
    xp.clip(table, low, high, out=table)
    return table
