"""refdml's layers and losses inside JAX programs (the extra ``jax``).

Every operator of :data:`refdml._interop.BRIDGED` is a ``jax.custom_vjp`` function: its
forward is refdml's fast path on NumPy, its backward refdml's hand-derived backward, both
reached through ``jax.pure_callback``; there is no autodiff through refdml's maths. They work
under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` (one callback per batch element).

>>> import jax, jax.numpy as jnp, refdml.jax
>>> l2 = refdml.jax.op("normalize.l2_normalize")
>>> g = jax.grad(lambda x: l2(x=x)[:, 0].sum())(jnp.ones((4, 3)))

* :func:`op` takes a catalogue name and the catalogue's keywords (JAX arrays for the arrays,
  Python values for the hyperparameters): what ``refdml conform`` and other tools iterate
  over (:func:`names`).
* float64 needs JAX's x64 mode (``jax.enable_x64``); float32, float16 and bfloat16 arrays
  are computed in float32 (float64 for the entropic OT operators) and rounded back.
* refdml runs on the CPU: arrays on a GPU or TPU are copied to the host and back, with a
  one-line :class:`HostRoundTripWarning` the first time each operator does so.

:mod:`refdml.jax._ops` says how the functions are built and why. Without JAX installed,
``import refdml.jax`` raises :class:`refdml.exceptions.MissingExtraError` naming the extra.
"""

from refdml.exceptions import MissingExtraError

MissingExtraError.require("jax", "jax")

from refdml.jax._ops import HostRoundTripWarning, JaxOp, names, op  # noqa: E402

__all__ = ["HostRoundTripWarning", "JaxOp", "names", "op"]
