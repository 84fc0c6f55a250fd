"""A DataLoader that knows how far it got, so a resumed run sees exactly the batches it had not consumed.

Position is stored globally — samples consumed in the current epoch across all
ranks — because rank ``r`` takes ``perm[r::world]``: after every rank consumed
``k`` samples the consumed set is exactly ``perm[:k*world]``, so a later
version can re-partition it for another world size. Counting happens when a
batch is handed to the training loop (consumed), not when a worker produces it
(prefetched). Shuffling and worker seeds come from generators seeded by
(seed, epoch), never from the global RNG, so creating an iterator draws nothing
from the RNG that dropout uses.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, Sampler

from ckptrun.runtime import collectives


class ResumableSampler(Sampler[int]):
    """Epoch-seeded permutation, split across ranks, that can start mid-epoch."""

    def __init__(self, length: int, rank: int, world_size: int, shuffle: bool, seed: int) -> None:
        self.length, self.rank, self.world_size = length, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.start = 0  # per-rank samples to skip in this epoch

    def order(self) -> list[int]:
        """This rank's indices for the epoch, all of them."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            perm = torch.randperm(self.length, generator=generator).tolist()
        else:
            perm = list(range(self.length))
        usable = self.length - self.length % self.world_size
        return perm[self.rank:usable:self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start:])

    def __len__(self) -> int:
        return max(0, self.length // self.world_size - self.start)


class DataLoader:
    """``torch.utils.data.DataLoader`` with a resumable position (drop-in for the common arguments).

    Iterating yields one epoch from the current position; the position is
    advanced as batches are consumed and rolls to the next epoch at the end.
    """

    def __init__(self, dataset: Dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0,
                 seed: int = 0, **loader_kwargs: Any) -> None:
        self.batch_size = batch_size
        self.world_size = collectives.world_size()
        self.sampler = ResumableSampler(len(dataset), collectives.rank(), self.world_size, shuffle, seed)  # type: ignore[arg-type]
        self.generator = torch.Generator()
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, sampler=self.sampler, num_workers=num_workers,
            drop_last=True, generator=self.generator, **loader_kwargs,
        )
        self.epoch = 0
        self.consumed = 0  # global samples consumed in this epoch
        self.samples_seen = 0  # global samples consumed since the start

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        return len(self.sampler.order()) // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        self.sampler.epoch = self.epoch
        self.sampler.start = self.consumed // self.world_size
        self.generator.manual_seed(self.sampler.seed * 7_919 + self.epoch)  # worker base seeds
        for batch in self.loader:
            self.consumed += self.global_batch
            self.samples_seen += self.global_batch
            yield batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples_consumed_in_epoch": self.consumed, "samples_seen": self.samples_seen,
                "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["samples_consumed_in_epoch"] % self.world_size:
            raise ValueError(f"position {state['samples_consumed_in_epoch']} does not split over {self.world_size} ranks")
        self.epoch = state["epoch"]
        self.consumed = state["samples_consumed_in_epoch"]
        self.samples_seen = state["samples_seen"]
