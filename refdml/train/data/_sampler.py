r"""The P-classes x K-samples batch sampler, seeded and resumable.

Every batch holds exactly ``P = n_classes_per_batch`` distinct classes with exactly
``K = n_samples_per_class`` samples each (``P K`` indices, grouped class by class), which is
what pair and proxy losses need (every anchor has ``K - 1`` positives in the batch).

One epoch (its plan is a pure function of ``(seed, epoch)``):

1. each class's sample indices are shuffled and cut into chunks of ``K``; a remainder of
   ``m mod K`` samples is left out of this epoch (a different remainder each epoch);
2. batches are formed while at least ``P`` classes have chunks left: ``P`` distinct classes
   are drawn without replacement with probability proportional to their remaining chunks
   (so classes deplete together and few chunks are stranded), and each gives its next chunk.

Every sample therefore appears at most once per epoch (except topped-up classes, below).

Classes with fewer than ``K`` samples (``short_classes``):

- ``"replace"`` (default): the class gives one chunk per epoch, all of its ``m`` samples plus
  ``K - m`` drawn again with replacement from them, so small classes still take part.
  Such a class needs ``m >= 2`` (a positive pair of two distinct samples) unless ``K == 1``;
  a class with a single sample raises a ValueError naming it.
- ``"skip"``: the class is never sampled.

Fewer than ``P`` usable classes raises a ValueError. Resuming: :meth:`state_dict` records the
seed, the epoch and the number of batches already handed out; :meth:`load_state_dict` on a
sampler built over the same labels with the same settings continues with the identical batches.
Index batches are NumPy int64 arrays (host side); the trainer gathers and moves the data.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import numpy as np

from refdml._validation import as_label_array, check_choice, check_rng, check_scalar

__all__ = ["PKBatchSampler"]


class PKBatchSampler:
    """Iterate over the index batches of one epoch per ``iter()`` (see module doc).

    Parameters
    ----------
    labels : (N,) integer labels of the dataset the indices refer to.
    n_classes_per_batch : int P >= 1.
    n_samples_per_class : int K >= 1.
    rng : None, a seed or a numpy Generator; one draw from it fixes the sampler's seed.
    short_classes : "replace" (default) or "skip", for classes with fewer than K samples.

    Notes
    -----
    Iterating stops early (``break``) and iterating again continues the same epoch where it
    stopped; an epoch that was handed out completely is followed by the next one.
    """

    def __init__(
        self,
        labels: Any,
        *,
        n_classes_per_batch: int,
        n_samples_per_class: int,
        rng: Any,
        short_classes: str = "replace",
    ) -> None:
        self._labels = as_label_array(labels, "labels")
        self.n_classes_per_batch = check_scalar(
            n_classes_per_batch, "n_classes_per_batch", low=1, integer=True)
        self.n_samples_per_class = check_scalar(
            n_samples_per_class, "n_samples_per_class", low=1, integer=True)
        self.short_classes = check_choice(short_classes, "short_classes", ("replace", "skip"))
        k = self.n_samples_per_class
        classes, inverse, counts = np.unique(self._labels, return_inverse=True, return_counts=True)
        if self.short_classes == "replace" and k > 1 and np.any(counts < 2):
            lonely = classes[counts < 2]
            raise ValueError(
                f"labels has classes with a single sample ({lonely[:10].tolist()}); with "
                f"n_samples_per_class == {k} and short_classes='replace' every class needs at "
                "least 2 samples (a positive pair); drop them or use short_classes='skip'"
            )
        usable = counts >= (1 if self.short_classes == "replace" else k)
        if int(usable.sum()) < self.n_classes_per_batch:
            raise ValueError(
                f"labels has {int(usable.sum())} classes usable with n_samples_per_class == {k} "
                f"(short_classes={self.short_classes!r}), fewer than n_classes_per_batch == "
                f"{self.n_classes_per_batch}"
            )
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(counts)[:-1]
        self._members = [m for m, ok in zip(np.split(order, bounds), usable) if ok]
        self._seed = int(check_rng(rng).integers(0, 2**63 - 1))
        self._epoch = 0
        self._position = 0
        self._cache: tuple[int, list[np.ndarray]] | None = None

    # -- the plan of an epoch ------------------------------------------------------------------
    def _plan(self, epoch: int) -> list[np.ndarray]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        gen = np.random.default_rng([self._seed, epoch])
        k, p = self.n_samples_per_class, self.n_classes_per_batch
        chunks: list[list[np.ndarray]] = []
        for members in self._members:
            shuffled = members[gen.permutation(members.shape[0])]
            if shuffled.shape[0] < k:
                extra = gen.choice(shuffled, size=k - shuffled.shape[0], replace=True)
                chunks.append([np.concatenate([shuffled, extra])])
            else:
                n_chunks = shuffled.shape[0] // k
                chunks.append(list(shuffled[: n_chunks * k].reshape(n_chunks, k)))
        remaining = np.array([len(c) for c in chunks], dtype=np.int64)
        batches = []
        while np.count_nonzero(remaining) >= p:
            picked = np.sort(gen.choice(remaining.shape[0], size=p, replace=False,
                                        p=remaining / remaining.sum()))
            batch = [chunks[c][len(chunks[c]) - remaining[c]] for c in picked]
            remaining[picked] -= 1
            batches.append(np.concatenate(batch).astype(np.int64))
        self._cache = (epoch, batches)
        return batches

    def __len__(self) -> int:
        """Batches in the current epoch (all of them, including those already handed out)."""
        return len(self._plan(self._epoch))

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[np.ndarray]:
        plan = self._plan(self._epoch)
        if self._position >= len(plan):
            self._epoch, self._position = self._epoch + 1, 0
            plan = self._plan(self._epoch)
        while self._position < len(plan):
            batch = plan[self._position]
            # Counted before it is handed out: a checkpoint taken after training on this
            # batch resumes with the next one.
            self._position += 1
            yield batch.copy()
        self._epoch, self._position = self._epoch + 1, 0

    # -- resuming ------------------------------------------------------------------------------
    def _fingerprint(self) -> str:
        digest = hashlib.sha256(self._labels.tobytes())
        digest.update(repr((self.n_classes_per_batch, self.n_samples_per_class,
                            self.short_classes)).encode())
        return digest.hexdigest()

    def state_dict(self) -> dict:
        """Plain-Python state: seed, epoch, batches handed out, and a fingerprint of the setup."""
        return {"seed": self._seed, "epoch": self._epoch, "position": self._position,
                "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a sampler with the same setup)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        missing = {"seed", "epoch", "position", "fingerprint"} - set(state)
        if missing:
            raise ValueError(f"state lacks the keys {sorted(missing)}")
        if state["fingerprint"] != self._fingerprint():
            raise ValueError(
                "state was saved by a sampler over other labels or with other settings "
                "(n_classes_per_batch, n_samples_per_class, short_classes); "
                "it cannot resume this one"
            )
        for key in ("seed", "epoch", "position"):
            check_scalar(state[key], f"state[{key!r}]", low=0, integer=True)
        seed, epoch, position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        saved = (self._seed, self._cache)
        self._seed, self._cache = seed, None
        n_batches = len(self._plan(epoch))
        if position > n_batches:
            self._seed, self._cache = saved
            raise ValueError(f"state['position'] == {position}, but epoch {epoch} of this sampler "
                             f"has {n_batches} batches")
        self._epoch, self._position = epoch, position
