"""Fault injection specs (contract C1's ``fault`` field), parsed without torch.

Grammar, several specs joined by ``;``::

    kill:rank=R:step=S                SIGKILL this rank once step S is done (after any save at S)
    kill:rank=R:step=S:micro=M        ... after M micro-batches of the step that follows S
    hang:rank=R:step=S                stop making progress (alive, silent) after step S
    exit:rank=R:step=S:code=C         exit with code C after step S
    kill-during-save:rank=R[:phase=P][:step=S]   SIGKILL while saving; P in PHASES
    kill-at:rank=R:after=T            SIGKILL T seconds (a float) after this rank's init(), whatever it is
                                      doing: a background save in flight is not waited for
    slow-save[:rank=R]:ms=M           test only: sleep M ms at every save hook (stage, each DCP file written,
                                      before-manifest, before-publish), so that timed kills land inside saves
    slow-retention[:rank=R]:ms=M      test only: sleep M ms once a save's outcome is known, before its result is
                                      handled, as a slow retention pass holds rank 0's writer after the others'
    nan:step=S                        test only: the step after S reports a NaN loss (anomaly policy)
    inf-grad:rank=R:step=S            test only: inf in this rank's gradient in the step after S (fp16)
    enospc[:rank=R][:step=S]          test only: this rank's snapshot writes fail with ENOSPC from step S on
    memory-enospc[:rank=R][:step=S]   test only: this rank's memory-tier writes fail with ENOSPC from step S on
    skip-rng-restore                  test only: restore everything except the RNG states
    bad-fork[:rank=R]                 test only: a forked (warm) rank sees ``torch.cuda._is_in_bad_fork()`` as
                                      True, as after a CUDA init in its agent (runtime/worker/fork_safety.py)
    nan-after[:rank=R]:step=S         test only: after step S this rank's parameters (every rank's without rank=)
                                      become NaN: a weight blow-up, once per process
    nan-recurring[:rank=R]:step=S     test only: as nan-after, but every time the run completes step S (again after
                                      each rollback to before it): a blow-up that comes back
    poison-after-restore:step=S       test only: right after restoring the snapshot of step S, the parameters
                                      become NaN (state that verifies and is poison); any attempt unless attempt=N
    nudge-replica:rank=R:step=S       test only: after step S one parameter element of rank R's replica moves by
                                      one ulp (silent data corruption on one device), once per process

Each fires on the first attempt only unless ``attempt=N`` or ``attempt=any`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("kill", "hang", "exit", "kill-during-save", "kill-at", "slow-save", "nan", "inf-grad", "enospc", "memory-enospc",
         "skip-rng-restore",
         "bad-fork",
         "nan-after", "nan-recurring", "poison-after-restore", "nudge-replica", "slow-retention")
SAVE_PHASES = ("stage", "persist", "before-manifest", "before-publish", "upload", "before-commit")  # the last two: object-store saves


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    micro: int | None = None
    code: int = 1
    phase: str = "persist"
    attempt: int | None = 1  # None: every attempt
    after: float | None = None  # kill-at: seconds after init()
    ms: int | None = None  # slow-save: sleep per save hook

    def applies(self, rank: int, attempt: int) -> bool:
        return (self.rank is None or self.rank == rank) and (self.attempt is None or self.attempt == attempt)


def parse_faults(spec: str | None) -> list[Fault]:
    """Parse a spec string; raises :class:`FaultSpecError` naming the bad part."""
    if not spec:
        return []
    return [_parse_one(part.strip()) for part in spec.split(";") if part.strip()]


def pending(spec: str | None, from_attempt: int, world: int | None) -> tuple[str | None, dict[str, str]]:
    """Of a stored spec (a resume's, whose first attempt is ``from_attempt`` on ``world`` ranks): the parts that
    can still fire, joined again (None: none), and each part that cannot, with why."""
    kept: list[str] = []
    spent: dict[str, str] = {}
    for part in (p.strip() for p in (spec or "").split(";") if p.strip()):
        fault = _parse_one(part)
        if fault.attempt is not None and fault.attempt < from_attempt:
            spent[part] = f"it fires on attempt {fault.attempt} only"
        elif world is not None and fault.rank is not None and fault.rank >= world:
            spent[part] = f"rank {fault.rank} is not among the {world} ranks"
        else:
            kept.append(part)
    return (";".join(kept) or None), spent


def _parse_one(text: str) -> Fault:
    kind, *pairs = text.split(":")
    if kind not in KINDS:
        raise FaultSpecError(f"fault {text!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    fields: dict[str, object] = {"kind": kind}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise FaultSpecError(f"fault {text!r}: {pair!r} is not key=value")
        if key == "phase":
            if value not in SAVE_PHASES:
                raise FaultSpecError(f"fault {text!r}: phase must be one of {', '.join(SAVE_PHASES)}")
            fields["phase"] = value
        elif key == "attempt" and value == "any":
            fields["attempt"] = None
        elif key == "after":
            try:
                fields["after"] = float(value)
            except ValueError:
                raise FaultSpecError(f"fault {text!r}: after must be seconds, got {value!r}") from None
            if not 0 <= fields["after"] < float("inf"):  # type: ignore[operator]
                raise FaultSpecError(f"fault {text!r}: after must be a finite number of seconds >= 0")
        elif key in ("rank", "step", "micro", "code", "attempt", "ms"):
            try:
                fields[key] = int(value)
            except ValueError:
                raise FaultSpecError(f"fault {text!r}: {key} must be an integer, got {value!r}") from None
        else:
            raise FaultSpecError(f"fault {text!r}: unknown key {key!r}")
    if kind == "poison-after-restore":
        fields.setdefault("attempt", None)  # keyed by the snapshot restored, whichever attempt restores it
    if kind in ("kill", "hang", "exit", "nan", "inf-grad", "nan-after", "nan-recurring", "poison-after-restore",
                "nudge-replica") \
            and "step" not in fields:
        raise FaultSpecError(f"fault {text!r}: needs step=S")
    if kind == "kill-at" and "after" not in fields:
        raise FaultSpecError(f"fault {text!r}: needs after=SECONDS")
    if kind in ("slow-save", "slow-retention") and "ms" not in fields:
        raise FaultSpecError(f"fault {text!r}: needs ms=M")
    return Fault(**fields)  # type: ignore[arg-type]
