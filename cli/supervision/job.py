"""The job an attempt belongs to: what the one ``supervise()`` loop asks before, between and after attempts.

A single-node run is a many-node run of one node. The loop in
:mod:`ckptrun.cli.supervision.supervisor` runs an attempt, watches it, and
after a failed one either decides what follows (it *leads*: restart from a
verified snapshot, or give up) or waits for the leader's word (it
*follows*). A :class:`Job` is what differs between the two shapes:
:class:`OneNode` leads a job of one node (nothing to gather, publish or
wait for), :class:`ckptrun.cli.supervision.node_agent.NodeJob` decides
through the job's store as node rank 0 or follows it. Importable without torch.
"""

from __future__ import annotations

from typing import Any, Protocol

from ckptrun.cli.supervision.observation import AttemptWatch, Outcome, Snapshot
from ckptrun.cli.supervision.policy import GiveUp

Next = tuple[int, Snapshot | None]  # the next attempt's number and the snapshot it resumes from (None: none)


class JobLost(Exception):
    """The job's coordination went away (the leader's store): this node's ranks are down, the run is resumable."""


class Job(Protocol):
    """The job-wide decisions around the loop, in the order it asks them."""

    @property
    def leads(self) -> bool:
        """This node decides what follows a failed attempt (else it follows the leader's word)."""
        ...

    def start(self, attempt: int, resume: Snapshot | None) -> Next | Outcome:
        """The first attempt this node runs (a follower: the leader's), or how the job ended before it."""
        ...

    def root_cause(self, watch: AttemptWatch) -> dict[str, Any] | None:
        """The failure the job agreed on for the failed attempt when another node saw it first (this node's
        is then collateral: a peer's connection error, a teardown); None when this node's is the root cause."""
        ...

    def torn_down(self, watch: AttemptWatch) -> None:
        """This node's ranks of a failed attempt are gone."""
        ...

    def gather(self, watch: AttemptWatch) -> GiveUp | None:
        """The leader, before its verdict: every node's part of the failure; a verdict when nodes are missing."""
        ...

    def restarting(self, watch: AttemptWatch, snapshot: Snapshot | None, pending: dict[str, Any] | None) -> None:
        """The leader restarts from ``snapshot``: tell the job (``pending``: the restart event being built)."""
        ...

    def follow(self, attempt: int) -> Next | Outcome:
        """A follower after ``attempt`` failed: the leader's next attempt, or its verdict."""
        ...

    def ended(self, outcome: Outcome, restarts: int) -> None:
        """The loop ended this way: the leader publishes it, a follower acknowledges it."""
        ...

    def lost(self, detail: str, restarts: int) -> Outcome:
        """:class:`JobLost` was raised: this node's ranks go down, the outcome is resumable."""
        ...


class OneNode:
    """A job of one node: it leads, there is nobody to wait for, and nothing to publish."""

    leads = True

    def start(self, attempt: int, resume: Snapshot | None) -> Next | Outcome:
        return attempt, resume

    def root_cause(self, watch: AttemptWatch) -> dict[str, Any] | None:
        return None

    def torn_down(self, watch: AttemptWatch) -> None:
        """No other node waits for this one's teardown acknowledgement."""

    def gather(self, watch: AttemptWatch) -> GiveUp | None:
        return None

    def restarting(self, watch: AttemptWatch, snapshot: Snapshot | None, pending: dict[str, Any] | None) -> None:
        """No follower to tell the next attempt and its snapshot: the loop starts it itself."""

    def follow(self, attempt: int) -> Next | Outcome:
        raise RuntimeError("a job of one node has no leader to follow")

    def ended(self, outcome: Outcome, restarts: int) -> None:
        """No follower to hand the verdict to: the outcome is this launcher's exit."""

    def lost(self, detail: str, restarts: int) -> Outcome:
        raise RuntimeError(f"a job of one node has no coordination to lose ({detail})")
