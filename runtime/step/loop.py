"""The training loop's two shapes and its step boundaries, mixed into :class:`~ckptrun.runtime.step.session.Run`.

A script loops either over steps (``for batch in run.batches(loader, steps)``)
or over epochs (``for epoch in run.epochs(E): for batch in loader:``). Either
way the runtime must know where one step ends and the next begins: the save
and the stop that ``end_step`` agreed on happen there — when the loop asks
``run.batches`` or a tracked ``ckr.DataLoader`` for its next batch, or a
``train_step`` begins — so the user's code after ``end_step``/``train_step``
runs first and its effects (a per-epoch scheduler step, an eval) are in the
snapshot. A ``ckr.DataLoader`` at the end of its epoch is not a boundary: the
epoch's closing code runs first, and the next epoch starts clean. A loop with
no such boundary (its own loader and ``end_step``) saves and stops inside
``end_step``. The end of either loop reads the last step's shared facts
(:mod:`step_end`): an anomaly in its loss can still roll back and train on.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from ckptrun.runtime.step.preflight import probe_of


class LoopShapes:
    """The step loop, the epoch loop and the boundary where a pending stop takes effect."""

    step: int
    epoch: int  # epochs completed by run.epochs (saved with the counters)
    total_steps: int | None
    _due: tuple[bool, bool] | None
    _defer: bool
    heart: Any
    env: Any
    world_size: int
    objects: dict[str, Any]

    if TYPE_CHECKING:  # provided by the other parts of Run; stubs here would shadow them in the MRO
        def _close_step(self) -> None: ...
        def _rolled_back_at_end(self) -> bool: ...
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...

    def batches(self, loader: Any, steps: int, accumulate: int = 1, global_batch: int | None = None) -> Iterator[Any]:
        """Yield one batch (or a list of ``accumulate`` micro-batches) per optimizer step until ``steps``.

        ``global_batch=G`` keeps the samples per step at G whatever the world size: the accumulation is
        G ÷ (batch size × world size), so a resharded run takes the same optimizer steps.
        """
        probe = probe_of(self)  # `ckptrun preflight` only: its step count, first batch, state digests
        steps = probe.step_count(steps) if probe is not None else steps
        self.total_steps = steps
        accumulate = self._accumulation(loader, accumulate, global_batch)
        iterator, empty_epochs = None, 0
        while self.step < steps or self._rolled_back_at_end():  # the last step's loss may still roll back
            self._boundary()
            if probe is not None:
                probe.boundary(self.step, self.env.attempt, self.objects)
            group: list[Any] = []
            while len(group) < accumulate:
                if iterator is None:
                    iterator = iter(loader)
                try:
                    group.append(next(iterator))
                    empty_epochs = 0
                except StopIteration:
                    iterator, empty_epochs = None, empty_epochs + 1
                    if empty_epochs > 1:
                        raise RuntimeError("the data loader yields no batch: dataset smaller than one global batch") from None
            self.heart.beat(self.step, "train")
            group = probe.batch(group) if probe is not None else group
            yield group[0] if accumulate == 1 else group
        self._boundary()

    def _accumulation(self, loader: Any, accumulate: int, global_batch: int | None) -> int:
        """Micro-batches per step: ``accumulate``, or what ``global_batch`` needs at this world size."""
        micro = getattr(loader, "micro_samples", None) or getattr(loader, "batch_size", 1) * self.world_size
        if global_batch is not None:
            if global_batch % micro or global_batch < micro:
                self._refuse(f"global_batch={global_batch} does not split into micro-batches of {micro} samples "
                             f"({micro // self.world_size} per rank × {self.world_size} ranks); pick a multiple of {micro}")
            accumulate = global_batch // micro
        if hasattr(loader, "saved_global_batch"):
            loader.global_batch = accumulate * micro  # the epoch's cut; the first step's end judges a change
        return accumulate

    def epochs(self, count: int) -> Iterator[int]:
        """Yield epoch numbers from the restored one up to ``count``; a tracked loader resumes mid-epoch by itself."""
        while self.epoch < count or self._rolled_back_at_end():
            self._boundary(per_step=False)
            yield self.epoch
            self.epoch += 1
        self._boundary(per_step=False)

    def _boundary(self, per_step: bool = True) -> None:
        """Between two steps: close the last one. A boundary met before every step lets end_step defer to it."""
        self._defer = self._defer or per_step
        if self._due is not None:
            self._close_step()


def untracked_loader_in_use(tracked: Iterable[Any]) -> bool:
    """Whether a live ``torch.utils.data`` iterator reads a dataset that no tracked object covers.

    Its position is not in any snapshot, so a resume restarts its epoch. Asked
    once, at the first save: a scan of live objects costs tens of milliseconds.
    """
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    covered = set()
    for obj in tracked:  # ckr.DataLoader and StatefulDataLoader are torch DataLoaders: their .dataset
        covered |= {id(obj), id(getattr(obj, "dataset", None))}
    live = (o for o in gc.get_objects() if issubclass(type(o), _BaseDataLoaderIter))  # type(): no __class__ hooks
    return any(id(o._dataset) not in covered for o in live)
