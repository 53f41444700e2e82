"""``refdml reproduce``: the papers' experiments at small scale, over seeds, on Dask.

- :mod:`._experiments`: the registry (:data:`EXPERIMENTS`: id, claim, runs, comparisons,
  settings per mode, settings chosen on validation);
- :mod:`._tasks`: a task ``(study, method, seed, settings)`` and :func:`execute`, a pure
  function of it; :mod:`._studies` the training studies; :mod:`._train` training on
  :mod:`refdml.train`'s loop, in memory;
- :mod:`._cache`: finished tasks on disk, keyed by the task and the code version;
- :mod:`._runner`: :func:`run_tasks` on a Dask LocalCluster or a given scheduler;
- :mod:`.stats` (public): the paired Student-t interval, Holm's adjustment, power, the
  gates and the verdicts;
- :mod:`._report`: lines, JSON, the Markdown report with figures.

docs/reproduce.md describes the experiments, the settings and the statistics.
"""

from refdml.reproduce._experiments import EXPERIMENTS, Comparison, Experiment, Selection
from refdml.reproduce._runner import Outcome, run_tasks
from refdml.reproduce.stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    compare,
    holm,
    paired_bootstrap,
    paired_interval,
    seeds_needed,
    summarise,
    verdict,
)
from refdml.reproduce._tasks import Task, code_version, execute, task_key

__all__ = [
    "EXPERIMENTS",
    "INCONCLUSIVE",
    "NOT_REPRODUCED",
    "REPRODUCED",
    "Comparison",
    "Experiment",
    "Outcome",
    "Selection",
    "Task",
    "code_version",
    "compare",
    "execute",
    "holm",
    "paired_bootstrap",
    "paired_interval",
    "run_tasks",
    "seeds_needed",
    "summarise",
    "task_key",
    "verdict",
]
