"""Checkpoint files of :class:`refdml.train.trainer.Trainer`: one ``.npz``, written atomically.

Layout (``numpy.savez``, no pickle; ``numpy.load(path)`` reads it back):

- ``param/<name>``: each parameter's value (host copy, its dtype);
- ``optim/<name>/<buffer>``: each optimiser buffer (Adam's ``m``, ``v``; SGD's momentum);
- ``meta``: a 0-d unicode array holding one JSON document with everything else (the
  optimiser's step count and hyperparameters, the schedule's and the sampler's state dicts,
  the trainer's Generator state ``bit_generator.state``, the objective's state if it has
  one, the epoch, the best validation MAP@R, ...). JSON keeps Python floats exactly (repr
  round-trips) and Python's 128-bit integers of the PCG64 state.

Atomic (:func:`refdml._io.atomic_path`): the file is written to a temporary file beside
``<path>``, fsynced, then moved over ``<path>`` with :func:`os.replace`, so a run killed
mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from refdml._io import atomic_path

__all__ = ["save_checkpoint", "load_checkpoint"]

_SEP = "/"


def _arrays_of_optimizer(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Split an optimiser state dict into its JSON part and its arrays."""
    arrays: dict[str, np.ndarray] = {}
    params: dict[str, Any] = {}
    for name, entry in state["params"].items():
        meta = {}
        for key, value in entry.items():
            if isinstance(value, np.ndarray):
                arrays[f"optim{_SEP}{name}{_SEP}{key}"] = value
                meta[key] = None
            else:
                meta[key] = list(value) if isinstance(value, tuple) else value
        params[name] = meta
    return {**{k: v for k, v in state.items() if k != "params"}, "params": params}, arrays


def _optimizer_from(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    params = {}
    for name, entry in meta["params"].items():
        restored = {}
        for key, value in entry.items():
            if value is None:
                restored[key] = arrays[f"optim{_SEP}{name}{_SEP}{key}"]
            elif key == "shape":
                restored[key] = tuple(value)
            else:
                restored[key] = value
        params[name] = restored
    hyper = {k: tuple(v) if isinstance(v, list) else v
             for k, v in meta["hyperparameters"].items()}
    return {**meta, "hyperparameters": hyper, "params": params}


_ARRAY_REF = "__array__"


def _arrays_out_of(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``value`` with every NumPy array (in dicts, lists, tuples) replaced by a reference
    ``{"__array__": key}``; the arrays go into ``arrays`` under ``meta/<n>``."""
    if isinstance(value, np.ndarray):
        key = f"meta{_SEP}{len([k for k in arrays if k.startswith('meta' + _SEP)])}"
        arrays[key] = value
        return {_ARRAY_REF: key}
    if isinstance(value, dict):
        return {k: _arrays_out_of(v, arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_arrays_out_of(v, arrays) for v in value]
    return value


def _arrays_into(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_ARRAY_REF}:
            return arrays[value[_ARRAY_REF]]
        return {k: _arrays_into(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_arrays_into(v, arrays) for v in value]
    return value


def save_checkpoint(path: Path, *, parameters: dict[str, np.ndarray],
                    optimizer_state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write parameters (host arrays), an optimiser state dict and a ``meta`` of JSON
    types and NumPy arrays (e.g. an objective's ``state_dict``; tuples come back as lists)."""
    optim_meta, arrays = _arrays_of_optimizer(optimizer_state)
    meta = _arrays_out_of(meta, arrays)
    for name, value in parameters.items():
        arrays[f"param{_SEP}{name}"] = value
    document = json.dumps({**meta, "optimizer": optim_meta})
    # savez on a handle: given a file name, it would append ".npz" to the temporary name
    with atomic_path(path) as temp, open(temp, "wb") as handle:
        np.savez(handle, meta=np.array(document), **arrays)


def load_checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """``(parameters, optimizer_state, meta)`` as :func:`save_checkpoint` was given them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    if "meta" not in arrays:
        raise ValueError(f"{path} is not a refdml.train checkpoint (no 'meta' entry)")
    meta = json.loads(str(arrays.pop("meta")))
    prefix = f"param{_SEP}"
    parameters = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    optimizer_state = _optimizer_from(meta.pop("optimizer"), arrays)
    meta = _arrays_into(meta, arrays)
    return parameters, optimizer_state, meta
