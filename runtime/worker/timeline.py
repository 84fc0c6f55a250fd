"""When this worker reached each start-up milestone: the relaunch broken down in the ``restored`` event.

A restart's RTO is mostly start-up; the supervisor sees only "launched" and "first step", so the worker
notes wall-clock times (``time.time()``, comparable with the supervisor's launch time) as it passes
each milestone, in order: the process started (noted only by a warm worker, a rank forked from its
agent, in ``warm_start.py``; otherwise the ``restored`` event reads it from psutil, up to a second
early), the bootstrap running (interpreter up, its imports done), ``import torch``
done, ``init()`` called (the script's own imports done), the process group up. A dict assignment
each: cheap enough to record always.
"""

from __future__ import annotations

import time

MILESTONES = ("process", "bootstrap", "torch_imported", "init", "process_group")  # process: warm workers only
MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Note the first time this process reaches ``name`` (one of :data:`MILESTONES`)."""
    MARKS.setdefault(name, time.time())
