"""A failure anywhere in the job, heard at once without asking the store every poll.

Each supervisor polls its own ranks every ``Timeouts().poll`` (0.2 s) and must
also learn, within a round trip, that another node's attempt failed. Asking the
store for it every poll — a wait on ``a<N>/failure`` bounded by the poll, then
its cancel — is ten requests a second per node: 10,000/s at 1,024 nodes, most of
the store's load and of each node's control-plane CPU. Instead one thread per
node holds a single long wait on the current attempt's failure key over a
connection of its own (a TCPStore client serves one caller at a time) and sets
an :class:`threading.Event` when the key appears; the poll loop checks the event
and sleeps on it. A wait that times out is renewed, so an idle node costs the
store two requests per :data:`HOLD_S` (a fifth of before). :meth:`close` waits
for the thread to leave its wait (at most :data:`HOLD_S`): a thread returning
from a store call while the interpreter finalises aborts the process.

Until the thread is waiting on the current attempt's key (it starts, it is
still finishing the previous attempt's wait, its connection failed),
:meth:`FailureAlarm.listening` is False and the caller asks the store itself,
as before. Importable without torch.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref

from ckptrun.cli.supervision.job_store import JobStore, StoreUnreachable

HOLD_S = 1.0  # one wait's length: renewing it costs a wait and a cancel; closing waits for it to end
RETRY_S = 1.0  # after the alarm's connection failed (the caller's own calls judge a lost leader)
_LIVE: "weakref.WeakSet[FailureAlarm]" = weakref.WeakSet()  # closed at exit, if their owner did not


class FailureAlarm:
    """Rings once per attempt when that attempt's failure key is written (by any node)."""

    def __init__(self, job: JobStore, hold_s: float = HOLD_S) -> None:
        self.job, self.hold_s = job, hold_s
        self._cond = threading.Condition()
        self._rung = threading.Event()
        self._armed: int | None = None  # the attempt to listen for
        self._listening: int | None = None  # the attempt whose key the thread waits on now (or has seen)
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, attempt: int) -> None:
        """Listen for ``attempt``'s failure from now on (an attempt's launch)."""
        if not self.job.batched:  # a store without a cancellable wait: the caller asks every poll
            return
        with self._cond:
            self._armed = attempt
            self._rung.clear()
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptrun-failure-alarm", daemon=True)
                self._thread.start()
                _LIVE.add(self)

    def listening(self, attempt: int) -> bool:
        """The thread waits on (or has seen) ``attempt``'s failure key: the event alone tells of it."""
        return self._listening == attempt

    def take(self, attempt: int) -> bool:
        """True once after ``attempt``'s failure key appeared (the caller reads it then)."""
        if self._listening != attempt or not self._rung.is_set():
            return False
        self._rung.clear()
        return True

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``, ended at once by a ring nobody has taken yet (True)."""
        return self._rung.wait(max(0.0, seconds))

    def close(self) -> None:
        """Stop listening, and wait for the thread to end (its current wait: at most :attr:`hold_s`)."""
        with self._cond:
            self._closed, self._listening = True, None
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.hold_s + 5.0)

    def _run(self) -> None:
        try:
            store = type(self.job).connect(self.job.run_id, self.job.store.host, self.job.port)
        except (StoreUnreachable, AttributeError):  # no second connection: the caller keeps asking
            return
        heard: int | None = None
        while True:
            with self._cond:
                while not self._closed and self._armed in (None, heard):
                    self._cond.wait()
                if self._closed:
                    return
                attempt = self._listening = self._armed
            try:
                if store.wait_for_failure(attempt, self.hold_s):  # type: ignore[arg-type]
                    heard = attempt
                    with self._cond:
                        if self._armed == attempt:
                            self._rung.set()
            except StoreUnreachable:
                with self._cond:
                    self._listening = None  # the caller asks the store itself meanwhile
                time.sleep(RETRY_S)


@atexit.register
def _close_all() -> None:
    for alarm in list(_LIVE):
        alarm.close()
