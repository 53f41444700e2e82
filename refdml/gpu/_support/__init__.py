"""What every kernel family of the fast path shares, one module per concern.

- :mod:`~refdml.gpu._support.modes`: the kernel modes (``refdml.gpu.use_kernels``) and
  :class:`~refdml.gpu._support.modes.Implementations`, the object of each family that holds
  its array path, CPU twin and CUDA kernels, chooses one per call, and loads the compiled
  ones on first use;
- :mod:`~refdml.gpu._support.cuda`: the one import point of ``numba.cuda``, and the registry
  where every ``@cuda.jit`` kernel is declared with the argument types of its launches;
- :mod:`~refdml.gpu._support.launch`: :func:`~refdml.gpu._support.launch.cuda_launch`, the one
  launcher of every CUDA kernel, and the launch-size constant ``BLOCK``;
- :mod:`~refdml.gpu._support.profile`: the launch profile (``REFDML_CUDA_PROFILE``);
- :mod:`~refdml.gpu._support.threading_layer`: Numba's threading layer and the lock around
  every parallel CPU twin;
- :mod:`~refdml.gpu._support.notice`: a line on stderr while a kernel compiles for long;
- :mod:`~refdml.gpu._support.scalar`: scalar ``@njit`` maths that several families' kernels
  call (the online log-sum-exp);
- :mod:`~refdml.gpu._support.occupancy`: a kernel's theoretical occupancy.

Importing the package imports none of them, and nothing here imports Numba until a compiled
kernel is used: the families (``refdml/gpu/<family>/``) load their ``_compiled`` and ``_cuda``
modules through their ``Implementations`` object.
"""
