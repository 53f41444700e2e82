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


#: Module -> the package that installs it, where the names differ (the message names the
#: package: ``pip install sklearn`` is not scikit-learn).
_DISTRIBUTIONS = {"sklearn": "scikit-learn"}


class MissingExtraError(ImportError):
    """A package of one of refdml's optional extras is not installed.

    The message comes first and says what to run, e.g. ``needs the "reproduce" extra
    (distributed is not installed): pip install "refdml[reproduce]"``; ``refdml`` prints it
    as one line with exit status 2. The :class:`ImportError` that found the package missing,
    if any, is chained as ``__cause__``.

    Parameters
    ----------
    extra : str
        The extra to install (``"plot"``, ``"train"``, ``"reproduce"``, ...).
    module : str
        The top-level module that is missing (``"distributed"``, ``"sklearn"``, ...); also
        the exception's ``name``.
    """

    def __init__(self, extra: str, module: str) -> None:
        self.extra = extra
        package = _DISTRIBUTIONS.get(module, module)
        super().__init__(f'needs the "{extra}" extra ({package} is not installed): '
                         f'pip install "refdml[{extra}]"', name=module)

    def __reduce__(self):
        return type(self), (self.extra, self.name)

    @staticmethod
    def require(extra: str, *modules: str) -> None:
        """Raise :class:`MissingExtraError` for the first of ``modules`` not installed.

        Looks the modules up without importing them (:func:`importlib.util.find_spec`), so
        that a command can check its extra before it starts its work.
        """
        from importlib.util import find_spec

        for module in modules:
            try:
                missing = find_spec(module) is None
            except (ImportError, ValueError):  # a finder refused it, or a broken parent
                missing = True
            if missing:
                raise MissingExtraError(extra, module)
