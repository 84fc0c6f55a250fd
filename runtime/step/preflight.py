"""The worker's side of ``ckptrun preflight``: one batch served over and over, and a digest of every state per step.

Preflight asks two questions the runtime alone can answer. *Does the model
learn?* — in ``learn`` mode ``run.batches`` hands the loop its first batch
(or group of micro-batches) at every step, so a model that works overfits it
and the loss falls. *Did every state come back?* — in ``resume`` mode rank 0
writes, at each step boundary (the state a snapshot of that step holds, or a
restore brings back), a digest of each tracked object, of the learning rate
and of the RNG states, to ``RUN_DIR/preflight-digests.jsonl``. The supervisor
side compares one attempt's digests with the next one's, after a kill and a
restore, and so names the state that did not come back — an untracked
scheduler shows as a learning rate that differs. This module owns that file's
format; its reader is importable without torch. Outside preflight (C1's
``preflight`` unset) nothing here runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

from ckptrun.runtime import records

DIGESTS = "preflight-digests.jsonl"


class Probe:
    """Per-run preflight state: the first batch group (``learn``) and the digest log (rank 0)."""

    def __init__(self, mode: str, steps: int | None, run_dir: Path, rank: int) -> None:
        self.mode, self.steps, self.run_dir, self.rank = mode, steps, run_dir, rank
        self.first: Any = None

    def step_count(self, asked: int) -> int:
        """The loop's length: preflight's own, whatever the script asked (which is logged, for the time to finish)."""
        if self.rank == 0:
            records.log_event(self.run_dir, "preflight", mode=self.mode, script_steps=asked, steps=self.steps)
        return self.steps if self.steps is not None else asked

    def batch(self, group: Any) -> Any:
        """``learn``: the first group, every step (the loader still advances; its batches are dropped)."""
        if self.mode != "learn":
            return group
        if self.first is None:
            self.first = group
        return self.first

    def boundary(self, step: int, attempt: int, objects: dict[str, Any]) -> None:
        """``resume``: rank 0 logs the digests of the state entering step ``step + 1`` (``learn`` is timed: no hashing)."""
        if self.rank == 0 and self.mode == "resume":
            records.append_jsonl(self.run_dir / DIGESTS, {"step": step, "attempt": attempt, **state_digests(objects)})


def probe_of(run: Any) -> Probe | None:
    """The run's probe, made on first use; None outside preflight."""
    if not getattr(run.env, "preflight", None):
        return None
    if getattr(run, "_preflight", None) is None:
        run._preflight = Probe(run.env.preflight, run.env.preflight_steps, run.run_dir, run.rank)
    return run._preflight


def state_digests(objects: dict[str, Any]) -> dict[str, str]:
    """One short digest per tracked object, the learning rates apart from the optimizer's state, and the RNG."""
    from ckptrun.runtime.step import rng

    digests: dict[str, str] = {}
    for name, obj in objects.items():
        state = obj.state_dict()
        if isinstance(state, dict) and "param_groups" in state:  # an optimizer: its lr is the scheduler's output
            groups = [{k: v for k, v in group.items() if k not in ("lr", "initial_lr")} for group in state["param_groups"]]
            digests["lr"] = _digest([group.get("lr") for group in state["param_groups"]])
            state = {**state, "param_groups": groups}
        digests[name] = _digest(state)
    digests["rng"] = _digest(rng.capture())
    return digests


def _digest(tree: Any) -> str:
    hasher = hashlib.blake2b(digest_size=8)
    for chunk in _chunks(tree):
        hasher.update(chunk)
    return hasher.hexdigest()


def _chunks(tree: Any) -> Iterator[bytes]:
    """Bytes of every leaf, in a fixed order: tensors by content (a shard: its local part), the rest as JSON."""
    import torch

    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield str(key).encode()
            yield from _chunks(tree[key])
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _chunks(item)
    elif isinstance(tree, torch.Tensor):
        tensor = tree.to_local() if hasattr(tree, "to_local") else tree
        yield str(tensor.dtype).encode()
        yield tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    else:
        yield json.dumps(tree, default=repr).encode()


def read_digests(run_dir: Path) -> dict[int, dict[int, dict[str, str]]]:
    """``{attempt: {step: {state: digest}}}`` from the digest log (torch-free)."""
    table: dict[int, dict[int, dict[str, str]]] = {}
    for record in records.read_jsonl(run_dir / DIGESTS):
        attempt, step = int(record.pop("attempt")), int(record.pop("step"))
        table.setdefault(attempt, {})[step] = record
    return table
