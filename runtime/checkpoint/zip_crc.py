"""torch.save without the zip CRC32 of each record, while snapshots persist.

Every byte of a snapshot is hashed into its manifest as it is written, and
``torch.load`` never checks the CRC (files without it load as before), so the
CRC is a second pass over the data for nothing: ~1 s of CPU per GiB, spent
holding the GIL on the writer thread — time the training thread waits for.
The option is process-wide: a ``torch.save`` elsewhere in the process while a
save persists also writes no CRC. Counted, so that overlapping saves (the
disk and the memory tier) restore the caller's setting once, when the last ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_lock = threading.Lock()
_users = 0  # saves persisting now, on any thread
_before = True  # the option as the first of them found it


@contextlib.contextmanager
def skipped() -> Iterator[None]:
    global _users, _before
    with _lock:
        if _users == 0:
            _before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                torch.serialization.set_crc32_options(_before)
