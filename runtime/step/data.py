"""A DataLoader that knows how far it got, so a resumed run sees exactly the batches it had not consumed.

The position is one global cursor — ``{epoch, samples_consumed, seed,
global_batch}`` — and the sampler does not depend on the world size
(Megatron-style): the epoch's permutation comes from ``(seed, epoch)`` over the
whole dataset, the samples from the cursor on are cut into micro-batches of
``batch_size × world`` and each micro-batch is sliced by rank. So a resume at
another world size starts exactly at the first unconsumed sample — none
skipped, none repeated — and a step of the same global batch consumes the same
samples at any world size. Position counts what a training step *consumed*,
not what a worker prefetched nor what an iterator handed out: each
``iter(loader)`` counts its own batches and the run commits the furthest one at
the end of a step, so a probe ``next(iter(loader))`` (or an iterator never
used) moves nothing, and new iterators start at the committed position.
Shuffling and worker seeds come from generators seeded by (seed, epoch), never
from the global RNG, so creating an iterator draws nothing from the RNG that
dropout uses.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

from ckptrun.runtime import collectives


class ResumableSampler(Sampler[int]):
    """This rank's slice of every micro-batch from ``start`` to ``end`` (global positions) of the epoch's permutation."""

    def __init__(self, length: int, rank: int, world_size: int, shuffle: bool, seed: int, batch_size: int = 1) -> None:
        self.length, self.rank, self.world_size, self.batch_size = length, rank, world_size, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.start, self.end = 0, length - length % (batch_size * world_size)  # global samples

    def permutation(self) -> list[int]:
        """The whole dataset's order for this epoch, the same at every world size."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def order(self) -> list[int]:
        """This rank's indices from ``start`` to ``end``: its ``batch_size`` slice of each micro-batch."""
        perm, micro, own = self.permutation(), self.batch_size * self.world_size, self.rank * self.batch_size
        return [i for first in range(self.start, self.end - micro + 1, micro)
                for i in perm[first + own:first + own + self.batch_size]]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())

    def __len__(self) -> int:
        return max(0, (self.end - self.start) // (self.batch_size * self.world_size) * self.batch_size)


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` with a resumable position (drop-in for the common arguments).

    A subclass: ``dataset``, ``sampler`` (a :class:`ResumableSampler`, this rank's
    share), ``batch_size`` (per rank), ``num_workers`` and the other keyword
    arguments are torch's. Iterating yields one epoch from the committed
    position; :meth:`commit` (called by the run at each step's end) advances it,
    and the iterator that reaches the epoch's end rolls it to the next epoch.
    ``len(loader)`` is the batches of a whole epoch on this rank.
    """

    sampler: ResumableSampler
    generator: torch.Generator

    def __init__(self, dataset: Dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0,
                 seed: int = 0, **loader_kwargs: Any) -> None:
        _refuse_unresumable(dataset, loader_kwargs)
        world_size = collectives.world_size()
        sampler = ResumableSampler(len(dataset), collectives.rank(), world_size, shuffle, seed, batch_size)  # type: ignore[arg-type]
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                         drop_last=True, generator=torch.Generator(), **loader_kwargs)
        self.world_size = world_size
        self.epoch = 0
        self.consumed = 0  # global samples consumed in this epoch
        self.samples_seen = 0  # global samples consumed since the start
        self.global_batch = self.micro_samples  # the unit an epoch is cut into (run.batches sets it)
        self.step_samples: int | None = None  # global samples the last optimizer step consumed (seen at commit)
        self.saved_global_batch: int | None = None  # the restored cursor's, to report a change
        self._seen_at_commit = 0  # samples_seen when the last step ended
        self.before_batch: Callable[[], None] | None = None  # the run's step boundary (a pending stop acts here)
        self._cursors: list[weakref.ref[_Cursor]] = []  # the live iterators (a list: commit reads it every step)

    @property
    def micro_samples(self) -> int:
        """Global samples one ``next()`` hands out: ``batch_size`` on every rank."""
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        return self.epoch_samples // self.micro_samples

    @property
    def epoch_samples(self) -> int:
        """Global samples one epoch hands out: whole global batches, the same at every world size."""
        return self.sampler.length // self.global_batch * self.global_batch

    def __iter__(self) -> Iterator[Any]:
        self.sampler.epoch = self.epoch
        self.sampler.start = self.consumed
        self.sampler.end = self.consumed + max(0, self.epoch_samples - self.consumed) // self.micro_samples * self.micro_samples
        self.generator.manual_seed(self.sampler.seed * 7_919 + self.epoch)  # worker base seeds
        cursor = _Cursor(self, super().__iter__())
        self._cursors = [ref for ref in self._cursors if ref() is not None] + [weakref.ref(cursor)]
        return cursor

    def commit(self) -> None:
        """A step consumed what the loop was handed: the position moves to the furthest live iterator of this epoch.

        What it consumed since the last step ended, across micro-batches and iterators (however the script
        accumulates: ``run.batches(..., accumulate=k)`` or its own loop of k batches per optimizer step), is
        the global batch the run really trains with (:attr:`step_samples`), recorded in the cursor."""
        furthest = self.consumed
        for ref in self._cursors:
            cursor = ref()
            if cursor is not None and cursor.epoch == self.epoch and cursor.position > furthest:
                furthest = cursor.position
        if furthest > self.consumed:
            self.samples_seen += furthest - self.consumed
            self.consumed = furthest
        taken, self._seen_at_commit = self.samples_seen - self._seen_at_commit, self.samples_seen
        if taken > 0:
            self.step_samples = taken

    def _epoch_done(self, cursor: _Cursor) -> None:
        """The loop asked past the last batch: everything was consumed, the next iterator starts the next epoch."""
        if cursor.epoch == self.epoch:
            self.samples_seen += max(0, cursor.position - self.consumed)
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The global cursor: no per-rank part, so it loads at any world size."""
        return {"epoch": self.epoch, "samples_consumed": self.consumed, "seed": self.sampler.seed,
                "global_batch": self.step_samples or self.global_batch, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "samples_consumed" not in state:  # a per-rank position from before the global cursor
            raise ValueError("this snapshot's data position is per rank (written before the global cursor); "
                             "resume it with the ckptrun version that wrote it")
        self.epoch, self.consumed, self.samples_seen = state["epoch"], state["samples_consumed"], state["samples_seen"]
        self._seen_at_commit = self.samples_seen
        self.sampler.seed = state["seed"]  # the position is a place in that seed's permutations
        self.saved_global_batch = state["global_batch"]


class _Cursor:
    """One ``iter(loader)``: counts the batches it handed out, from the position committed when it was made."""

    def __init__(self, owner: DataLoader, batches: Iterator[Any]) -> None:
        self.owner, self.batches = owner, batches
        self.epoch, self.micro = owner.epoch, owner.micro_samples
        self.position = owner.consumed  # global samples: where it started, plus what it handed out

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> Any:
        if self.owner.before_batch is not None and self.position < self.owner.epoch_samples:
            self.owner.before_batch()  # not at the epoch's end: its closing code runs before the boundary
        try:
            batch = next(self.batches)
        except StopIteration:
            self.owner._epoch_done(self)
            raise
        self.position += self.micro
        return batch


def _refuse_unresumable(dataset: Dataset, loader_kwargs: dict[str, Any]) -> None:
    """What ckr.DataLoader cannot resume exactly, refused in one line that names the alternative."""
    if isinstance(dataset, IterableDataset):
        raise TypeError(f"ckr.DataLoader needs a map-style dataset (__len__/__getitem__), not the IterableDataset "
                        f"{type(dataset).__name__}: give it state_dict/load_state_dict and run.track(data=it), or use "
                        "torchdata's StatefulDataLoader and run.track(loader=...)")
    for key in ("sampler", "batch_sampler"):
        if loader_kwargs.get(key) is not None:
            raise TypeError(f"ckr.DataLoader orders and shards samples itself and cannot resume a user {key}=: drop it, "
                            "or use torchdata's StatefulDataLoader (with a sampler that has state_dict) and "
                            "run.track(loader=...)")
