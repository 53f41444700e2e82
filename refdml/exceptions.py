"""Warning and error classes of refdml."""


class RefdmlWarning(UserWarning):
    """Base class of every warning refdml emits."""


class ConvergenceWarning(RefdmlWarning):
    """An iterative solver stopped at ``max_iter`` before reaching its tolerance.

    The result object it returned still carries ``n_iter``, ``residual`` and
    ``converged=False``; filter this warning if a fixed iteration count is intended.
    """


class NonFiniteGradient(ValueError, FloatingPointError):
    """A gradient, or the update computed from it, is NaN or inf.

    Raised where the value is found (the training loop's check of the objective's gradient;
    :class:`refdml.train.optim.NonFiniteStepError`, its subclass, by an optimiser step),
    before any parameter changes, so that callers tell a divergence from other bad values
    by type. A ``ValueError`` (what an optimiser raised for a non-finite gradient before
    this class) and a ``FloatingPointError``.
    """
