"""Warning classes of refdml."""


class RefdmlWarning(UserWarning):
    """Base class of every warning refdml emits."""


class ConvergenceWarning(RefdmlWarning):
    """An iterative solver stopped at ``max_iter`` before reaching its tolerance.

    The result object it returned still carries ``n_iter``, ``residual`` and
    ``converged=False``; filter this warning if a fixed iteration count is intended.
    """
