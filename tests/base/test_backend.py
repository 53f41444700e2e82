"""The backend object (refdml/_backend.py): what differs between NumPy and CuPy."""

from __future__ import annotations

import dataclasses

import numpy as np

from refdml._backend import get_backend


# ---- for refdml.gpu.ot
def test_gathers_rows_where_host_reads_are_free():
    # NumPy reads a mask's count for free, so a data-dependent subset of rows is gathered;
    # a backend whose host reads synchronise the device (CuPy) works on every row instead.
    numpy_backend = get_backend(np.zeros(3))
    assert numpy_backend.gathers_rows is True
    device_like = dataclasses.replace(numpy_backend, free_host_reads=False)
    assert device_like.gathers_rows is False


def test_near_pairs_are_refined_where_finding_them_is_free():
    numpy_backend = get_backend(np.zeros(3))
    assert numpy_backend.refines_near_pairs is True
    assert dataclasses.replace(numpy_backend, free_host_reads=False).refines_near_pairs is False
