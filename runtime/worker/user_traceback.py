"""The traceback a person sees when their script raises: it starts at their own code.

A script runs under ``warm_start`` → ``bootstrap`` → ``runpy``; without trimming, every traceback of a
user's bug opens with those frames and reads like ckptrun's. The leading frames that are ckptrun's
worker shims or ``runpy`` are dropped; frames further in (the script calling into ``ckptrun.runtime``)
stay, they are part of the user's story. ``CKPTRUN_DEBUG=1`` (``ckptrun --debug launch``) keeps
everything. Importable without torch.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from types import TracebackType

from ckptrun.runtime.env import variable

WORKER_DIR = os.path.dirname(os.path.abspath(__file__))
RUNPY_FILES = frozenset({runpy.__file__, "<frozen runpy>"})


def shim_frame(filename: str) -> bool:
    """A frame of the worker shims (this package) or of runpy, which only ever sit above the script."""
    return filename in RUNPY_FILES or os.path.dirname(os.path.abspath(filename)) == WORKER_DIR


def user_part(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from its first frame that is not a shim's; None when every frame is ours (the script never ran:
    a missing file, a syntax error, whose message names the file and line itself)."""
    while tb is not None and shim_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def debug_wanted() -> bool:
    return os.environ.get(variable("debug"), "").lower() in ("1", "true", "yes")


def format_user_exception(exc: BaseException, full: bool | None = None) -> str:
    """The traceback text of ``exc`` as Python prints it, from the user's first frame unless ``full``."""
    full = debug_wanted() if full is None else full
    tb = exc.__traceback__ if full else user_part(exc.__traceback__)
    return "".join(traceback.format_exception(type(exc), exc, tb))


def print_user_exception(exc: BaseException) -> None:
    sys.stderr.write(format_user_exception(exc))
    sys.stderr.flush()
