"""Why an attempt could not load the snapshot it was given, in words a person can act on.

The ranks agree on a load failure and rank 0 records it as a ``restore_failed``
event whose ``reason`` joins the failing ranks' first lines
(:func:`ckptrun.runtime.checkpoint.snapshot.load`). With chunk digests (schema 3) the usual
cause is bytes that do not match their digest as they are read — ``rank R:
DigestMismatch: dcp/__R_0.safetensors bytes A..B (tensor 'k'): sha256 …, manifest
says …`` for a stored item, ``rank R: DigestMismatch: state.json: …`` for a
small file. The supervisor checked only manifest and sizes before the
relaunch, so that is damage found at load, not a snapshot that "verifies".
Anything else (a pickle that is not tensors, a state that does not fit the
model) is a snapshot whose bytes match but that does not load. Importable
without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_DIGEST = re.compile(r"rank (\d+): DigestMismatch: (.+?)(?=; rank \d+: |$)")
DIGEST, LOAD = "digest", "load"


@dataclass(frozen=True)
class DigestFailure:
    """One rank's bytes that failed their digest: the file and, for a stored item, its range and tensor."""

    rank: int
    where: str  # "dcp/__1_0.safetensors bytes 10..20 (tensor 'w')", or a small file's name

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "where": self.where}


def digest_failures(reason: str) -> list[DigestFailure]:
    """The digest failures a ``restore_failed`` reason names, in its order (empty: another cause)."""
    return [DigestFailure(int(rank), _where(detail)) for rank, detail in _DIGEST.findall(reason)]


def _where(detail: str) -> str:
    """``dcp/x bytes A..B (tensor 'k'): sha256 12…, manifest says 34…`` → ``dcp/x bytes A..B (tensor 'k')``."""
    head = detail.split(", manifest says", 1)[0]
    return head.rsplit(": ", 1)[0] if ", manifest says" in detail else head


def cause(reason: str) -> str:
    return DIGEST if digest_failures(reason) else LOAD


def status(reason: str) -> str:
    """The quarantine status, as ``ckptrun verify`` names it: bytes that fail their digest are corrupt."""
    return "corrupt" if digest_failures(reason) else "unloadable"


def describe(step: int, reason: str, moved: Path) -> str:
    """The supervisor's line for a snapshot it set aside because the attempt could not load it."""
    failures = digest_failures(reason)
    if not failures:
        short = reason if len(reason) <= 200 else reason[:200] + "…"
        return (f"snapshot step {step} passed its checks but does not load ({short or 'no reason given'}): "
                f"quarantined, moved to {moved}")
    first, more = failures[0], (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "")
    return (f"snapshot step {step} failed its digest at load: rank {first.rank} read {first.where}{more}, "
            f"which does not match the manifest: quarantined, moved to {moved}")
