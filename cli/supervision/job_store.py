"""The job's shared facts across nodes, kept in one ``torch.distributed.TCPStore`` the leader hosts.

Node rank 0's supervisor hosts the store (``is_master=True``,
``wait_for_workers=False``) on the rendezvous host at a port of its own — never
torchrun's rendezvous port — and keeps it for the whole job, across every
attempt; the other supervisors connect as clients with a bounded timeout.
Keys live under ``ckptrun/<run>/`` and hold small JSON documents:

    node/<k>              node k's supervisor: pid, host, incarnation (a relaunched launcher bumps it)
    heartbeat/<k>         node k's supervisor is alive: time, attempt, state
    attempt               the attempt every node runs now, and the snapshot it resumes from
    a<N>/failure          the first failure of attempt N (node, ranks, cause): compare_set, first writer wins
    a<N>/down/<k>         node k has torn attempt N down
    a<N>/verify           the leader's candidate snapshot for attempt N+1, round r: every node verifies a share
    a<N.r>/verify/<k>     node k's verdict on its share of round r's candidate
    stop                  a stop asked on any node (signal, ``ckptrun stop``, time limit)
    verdict               how the job ends, decided by the leader: done, stopped, gave up, requeue
    news, news/<n>        the leader's n-th word to the followers, written when ``attempt``, ``a<N>/verify`` or
                          ``verdict`` changed and holding the latest of all three (then the count ``news`` moves):
                          a follower between attempts reads one word, then waits for the next
    ckpt_token            the token the leader wrote into the checkpoint dir (same storage everywhere?)
    spare/joins           how many spare launchers joined (``launch --spare``): spare s is the s-th
    spare/<s>             spare s: pid, host; spare/<s>/beat its heartbeat; spare/<s>/promoted the node it takes
    node/index, heartbeat/index, a<N>/down/index, a<N.r>/verify/index
                          the nodes that wrote a key of that family: each appends ``k,`` once, after its key

Reads cost the leader a constant number of round trips, not one or two per node: a key once seen is
known to exist (no key is ever deleted), so the known keys of a read are fetched in one ``multi_get``;
a family's index says in one request which of its keys exist. torch's extended store API (``append``,
``multi_get``: torch 2.1) is used where the store has it, else one ``check`` and ``get`` per key.

The store has no TTL and no watch, but a key that is written once is an event: a waiter blocks on the keys
it expects (``TCPStore.wait``, :meth:`JobStore.wait_for`), so each hop of a restart takes one round trip,
not up to a poll. Every supervisor's failure alarm (:mod:`~ckptrun.cli.supervision.failure_alarm`) holds a
wait on its attempt's ``a<N>/failure``; the leader waits on the ``node/<k>`` and ``a<N>/down/<k>`` keys it
lacks, a follower between attempts on ``news/<n>``, since one wait needs *all* its keys and the leader's
next word may be a verify round, an attempt or a verdict. A
node whose heartbeat stops changing is still judged stale by the observer's own clock (no clock agreement
needed between hosts). When the leader is gone every store call fails: :class:`StoreUnreachable`. torch is
imported here lazily (only a multi-node launch builds a :class:`JobStore`; the import costs seconds once).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable

from ckptrun.cli.supervision.node_list import nodes_listed, pack_nodes

LEADER_LOST_S = 3.0  # a client that cannot reach the leader's store this long tears down and exits (requeue)
DEFAULT_TIMEOUT_S = 10.0  # a client's connect and blocking-call limit: how long a lost leader can keep it waiting


class StoreUnreachable(Exception):
    """The leader's store cannot be reached: the leader (or its host) is gone."""


def _tcp_store(host: str, port: int, is_master: bool, timeout_s: float) -> Any:
    """A TCPStore, importing torch quietly (c10d's C++ warnings would otherwise flood the launcher's terminal)."""
    if "torch" not in sys.modules:
        previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # read once, when libtorch loads
        try:
            import torch.distributed  # noqa: F401
        finally:
            if previous is None:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)  # the attempts' ranks keep the user's setting
            else:
                os.environ["TORCH_CPP_LOG_LEVEL"] = previous
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistNetworkError / DistStoreError
        raise StoreUnreachable(f"{host}:{port}: {str(exc).splitlines()[0]}") from None


@dataclass
class JobStore:
    """Typed access to the job's keys; every call raises :class:`StoreUnreachable` once the leader is gone."""

    store: Any
    run_id: str
    is_leader: bool = False
    known: set[str] = field(default_factory=set, init=False, repr=False)  # keys seen to exist (never deleted)
    listed: set[tuple[str, str]] = field(default_factory=set, init=False, repr=False)  # (index, member) appended
    failures: dict[str, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)  # a<N>/failure, read
    said: dict[str, Any] = field(default_factory=dict, init=False, repr=False)  # the leader's: its latest words
    told: int = field(default=0, init=False, repr=False)  # the leader's: words said

    def __post_init__(self) -> None:
        self.batched = bool(getattr(self.store, "has_extended_api", lambda: False)())  # append, multi_get

    @classmethod
    def host(cls, run_id: str, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "JobStore":
        """The leader's store (port 0: a free one, read back with :attr:`port`); it lives as long as this object."""
        return cls(_tcp_store(host, port, True, timeout_s), run_id, is_leader=True)

    @classmethod
    def connect(cls, run_id: str, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "JobStore":
        """A client of the leader's store; fails after ``timeout_s`` when nobody listens."""
        return cls(_tcp_store(host, port, False, timeout_s), run_id)

    @property
    def port(self) -> int:
        return int(self.store.port)

    # --- raw access -------------------------------------------------------------------

    def key(self, *parts: object) -> str:
        return "/".join(["ckptrun", self.run_id, *map(str, parts)])

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.store, method)(*args)
        except RuntimeError as exc:  # DistStoreError, DistNetworkError
            first = str(exc).splitlines()[0]
            if method == "wait" and first.startswith("wait timeout"):  # the keys are not there yet
                raise TimeoutError(first) from None
            raise StoreUnreachable(f"the job's store ({method}): {first}") from None

    def put(self, key: str, value: dict[str, Any]) -> None:
        self._call("set", key, json.dumps(value))

    def read(self, key: str) -> dict[str, Any] | None:
        """The document at ``key``, or None when nobody wrote it yet (never blocks)."""
        if key not in self.known and not self._call("check", [key]):
            return None
        self.known.add(key)
        return json.loads(self._fetch([key])[0])

    def _fetch(self, keys: list[str]) -> list[Any]:
        """The values of keys known to exist, in one request (a missing key would block until the timeout)."""
        if not self.batched:
            return [self._call("get", key) for key in keys]
        return [value for start in range(0, len(keys), 4096) for value in self._call("multi_get", keys[start:start + 4096])]

    def _put_listed(self, index: str, member: object, key: str, value: dict[str, Any], sync: bool = True) -> None:
        """Write ``key``, then list ``member`` in ``index`` (once per client): a reader that finds it listed
        knows the key exists (one connection's requests are served in order). ``set`` and ``append`` get no
        answer: the first write waits for one (a ``check``), so it is visible to every client once it returns;
        ``sync=False``: not waited for (the caller's next request on this connection comes after it anyway)."""
        self.put(key, value)
        if self.batched and (index, str(member)) not in self.listed:
            self._call("append", index, f"{member},")
            if sync:
                self._call("check", [index])
            self.listed.add((index, str(member)))

    def _members(self, index: str) -> set[str]:
        if index not in self.known and not self._call("check", [index]):
            return set()
        self.known.add(index)
        raw = self._fetch([index])[0]
        return set((raw.decode() if isinstance(raw, bytes) else str(raw)).split(",")) - {""}

    def first(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        """Write ``value`` unless someone wrote ``key`` first; returns what the key holds (the winner)."""
        winner = json.loads(self._call("compare_set", key, "", json.dumps(value)))
        self.known.add(key)
        return winner

    def wait_for(self, keys: list[str], timeout_s: float) -> bool:
        """Block until every key exists (True, at once when they do: a waiter wakes on the writer's key, not on
        its next poll) or ``timeout_s`` passes (False). Used where the store has the extended API: there a wait that
        times out is cancelled and its connection stays usable (tested); elsewhere it sleeps, then checks."""
        missing, timeout_s = [key for key in keys if key not in self.known], max(timeout_s, 0.001)
        if not missing:
            return True
        if not self.batched:
            time.sleep(timeout_s)
            if not self._call("check", missing):
                return False
        else:
            try:
                self._call("wait", missing, timedelta(seconds=timeout_s))
            except TimeoutError:
                return False
        self.known.update(missing)
        return True

    def read_many(self, keys: Iterable[tuple[int, str]], index: str | None = None) -> dict[int, dict[str, Any]]:
        """The documents of those keys that exist, by member; ``index``: the family's index (its writers list
        themselves there), which says in one request which of the keys not known yet exist."""
        pairs = list(keys)
        unknown = [key for _, key in pairs if key not in self.known]
        if unknown and index is not None and self.batched:
            listed = self._members(index)
            self.known.update(key for member, key in pairs if str(member) in listed)
        elif unknown and self._call("check", unknown):  # all of them exist: one request
            self.known.update(unknown)
        elif len(unknown) > 1:
            self.known.update(key for key in unknown if self._call("check", [key]))
        present = [(member, key) for member, key in pairs if key in self.known]
        return {member: json.loads(value) for (member, _), value in zip(present, self._fetch([k for _, k in present]))}

    # --- nodes --------------------------------------------------------------------------

    def join(self, node: int, **facts: Any) -> int:
        """Node ``node``'s supervisor arrives; returns its incarnation (1, then 2 for a relaunched one…)."""
        incarnation = int(self._call("add", self.key("node", node, "joins"), 1))
        self._put_listed(self.key("node", "index"), node, self.key("node", node),
                         {"node": node, "incarnation": incarnation, "time": time.time(), "pid": os.getpid(), **facts})
        return incarnation

    def node(self, node: int) -> dict[str, Any] | None:
        return self.read(self.key("node", node))

    def wait_for_joins(self, nodes: Iterable[int], timeout_s: float) -> bool:
        return self.wait_for([self.key("node", n) for n in nodes], timeout_s)

    def nodes(self, nodes: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The records of those nodes that joined, in a constant number of requests (``node`` reads one)."""
        return self.read_many(((n, self.key("node", n)) for n in nodes), self.key("node", "index"))

    def beat(self, node: int, **facts: Any) -> None:
        self._put_listed(self.key("heartbeat", "index"), node, self.key("heartbeat", node),
                         {"node": node, "time": time.time(), **facts})

    def heartbeats(self, nodes: Iterable[int]) -> dict[int, dict[str, Any]]:
        return self.read_many(((n, self.key("heartbeat", n)) for n in nodes), self.key("heartbeat", "index"))

    # --- spares -------------------------------------------------------------------------

    def join_spare(self, **facts: Any) -> int:
        """A spare launcher arrives (it takes no rank until the leader promotes it); returns its number (1, 2…)."""
        spare = int(self._call("add", self.key("spare", "joins"), 1))
        self.put(self.key("spare", spare), {"spare": spare, "time": time.time(), "pid": os.getpid(), **facts})
        return spare

    def spares(self) -> dict[int, dict[str, Any]]:
        """Every spare that joined, with its promotion (``promoted``: the node it took) if any."""
        count = int(self._call("add", self.key("spare", "joins"), 0))
        found = self.read_many((s, self.key("spare", s)) for s in range(1, count + 1))
        for spare, promoted in self.read_many((s, self.key("spare", s, "promoted")) for s in found).items():
            found[spare]["promoted"] = promoted
        return found

    def beat_spare(self, spare: int, **facts: Any) -> None:
        self.put(self.key("spare", spare, "beat"), {"spare": spare, "time": time.time(), **facts})

    def spare_beats(self, spares: Iterable[int]) -> dict[int, dict[str, Any]]:
        return self.read_many((s, self.key("spare", s, "beat")) for s in spares)

    def promote_spare(self, spare: int, node: int, attempt: int) -> dict[str, Any]:
        """The leader gives spare ``spare`` node rank ``node`` from the attempt after ``attempt`` (first writer wins)."""
        return self.first(self.key("spare", spare, "promoted"), {"node": node, "attempt": attempt, "time": time.time()})

    def promotion(self, spare: int) -> dict[str, Any] | None:
        return self.read(self.key("spare", spare, "promoted"))

    # --- attempts -----------------------------------------------------------------------

    def start_attempt(self, attempt: int, snapshot: dict[str, Any] | None, nodes: list[int]) -> None:
        """The leader's word: every node runs ``attempt`` from ``snapshot`` (step, digest, path; None: scratch)."""
        record = {"attempt": attempt, "snapshot": snapshot, "nodes": pack_nodes(nodes), "time": time.time()}
        self.put(self.key("attempt"), record)
        self._tell(attempt=record)

    def attempt(self) -> dict[str, Any] | None:
        return nodes_listed(self.read(self.key("attempt")))

    def _tell(self, **said: Any) -> None:
        """After the leader wrote what the followers wait for: its next word, ``news/<n>``, wakes them and holds
        all it said so far (the attempt, the verify round, the verdict), so a woken follower reads one key. The
        count moves after the word is written, on the same connection: ``news/<count>`` always exists."""
        self.said.update(said, time=time.time())
        self.told += 1
        self.put(self.key("news", self.told), self.said)
        self._call("add", self.key("news"), 1)

    def news(self) -> int:
        """How many words the leader said so far (read it, :meth:`word` it, then wait for the next)."""
        return int(self._call("add", self.key("news"), 0))

    def word(self, n: int) -> dict[str, Any]:
        """The leader's ``n``-th word (it exists: counted or waited for): its latest attempt, verify, verdict."""
        self.known.add(self.key("news", n))
        word = json.loads(self._fetch([self.key("news", n)])[0])
        return {**word, "attempt": nodes_listed(word.get("attempt")), "verify": nodes_listed(word.get("verify"))}

    def wait_for_news(self, after: int, timeout_s: float) -> bool:
        """The leader said something after its ``after``-th word (an attempt, a verify round, the verdict)."""
        return self.wait_for([self.key("news", after + 1)], timeout_s)

    def report_failure(self, attempt: int, node: int, ranks: list[int], cause: str, yield_s: float = 0.0,
                       **facts: Any) -> dict[str, Any]:
        """Record this failure of ``attempt`` unless another node's came first; returns the first one.
        ``yield_s``: this node saw only a peer's connection error (collateral of a failure elsewhere), so it
        first waits that long for the node where the rank really died to report (its signal or exception)."""
        key = self.key(f"a{attempt}", "failure")
        if key in self.failures:  # read already (a collateral failure): first writer won, nothing to send
            return self.failures[key]
        mine = {"attempt": attempt, "node": node, "ranks": ranks, "cause": cause, "time": time.time(), **facts}
        deadline = time.monotonic() + yield_s
        while time.monotonic() < deadline:
            if (other := self.failure(attempt)) is not None:
                return other
            time.sleep(0.1)
        self.failures[key] = self.first(key, mine)
        return self.failures[key]

    def failure(self, attempt: int, exists: bool = False) -> dict[str, Any] | None:
        """``attempt``'s first failure (written once: kept once read); ``exists``: the alarm rang (one request)."""
        key = self.key(f"a{attempt}", "failure")
        if key not in self.failures:
            if exists:
                self.known.add(key)
            if (first := self.read(key)) is None:
                return None
            self.failures[key] = first
        return self.failures[key]

    def wait_for_failure(self, attempt: int, timeout_s: float) -> bool:
        """True when a node reported ``attempt``'s failure within ``timeout_s``; False at once when this client
        knew of it already (it has read it: nothing new to wake for)."""
        key = self.key(f"a{attempt}", "failure")
        return key not in self.known and self.wait_for([key], timeout_s)

    def ack_teardown(self, attempt: int | str, node: int, **facts: Any) -> None:
        """Node ``node`` tore ``attempt`` down (``"end"``: the job's end, waited for: the launcher exits next)."""
        self._put_listed(self.key(f"a{attempt}", "down", "index"), node, self.key(f"a{attempt}", "down", node),
                         {"node": node, "time": time.time(), **facts}, sync=attempt == "end")

    def teardown_acked(self, attempt: int | str, nodes: Iterable[int]) -> set[int]:
        """Which of ``nodes`` acknowledged the teardown: their index in one request, the documents unread."""
        listed = self._members(self.key(f"a{attempt}", "down", "index")) if self.batched else None
        return set(self.teardown_acks(attempt, nodes)) if listed is None else {n for n in nodes if str(n) in listed}

    def teardown_acks(self, attempt: int | str, nodes: Iterable[int]) -> dict[int, dict[str, Any]]:
        return self.read_many(((n, self.key(f"a{attempt}", "down", n)) for n in nodes),
                              self.key(f"a{attempt}", "down", "index"))

    def wait_for_acks(self, attempt: int | str, nodes: Iterable[int], timeout_s: float) -> bool:
        return self.wait_for([self.key(f"a{attempt}", "down", n) for n in nodes], timeout_s)

    def ask_verify(self, attempt: int, round: int, path: str, nodes: list[int]) -> None:
        """The leader's candidate for the attempt after ``attempt``: every node verifies its share of it."""
        asked = {"attempt": attempt, "round": round, "path": path, "nodes": pack_nodes(nodes), "time": time.time()}
        self.put(self.key(f"a{attempt}", "verify"), asked)
        self._tell(verify=asked)

    def post_verify(self, attempt: int | str, node: int, ok: bool, files: int, seconds: float, problems: list[str]) -> None:
        self._put_listed(self.key(f"a{attempt}", "verify", "index"), node, self.key(f"a{attempt}", "verify", node),
                         {"node": node, "ok": ok, "files": files, "seconds": seconds, "problems": problems[:5]})

    def verify_verdicts(self, attempt: int | str, nodes: Iterable[int]) -> dict[int, dict[str, Any]]:
        return self.read_many(((n, self.key(f"a{attempt}", "verify", n)) for n in nodes),
                              self.key(f"a{attempt}", "verify", "index"))

    def wait_for_verdicts(self, attempt: int | str, nodes: Iterable[int], timeout_s: float) -> bool:
        return self.wait_for([self.key(f"a{attempt}", "verify", n) for n in nodes], timeout_s)

    # --- the job's end ------------------------------------------------------------------------

    def request_stop(self, node: int, reason: str) -> dict[str, Any]:
        """Ask every node to save and stop; returns the first request (several nodes may ask at once)."""
        return self.first(self.key("stop"), {"node": node, "reason": reason, "time": time.time()})

    def stop_request(self) -> dict[str, Any] | None:
        return self.read(self.key("stop"))

    def set_verdict(self, action: str, code: int, message: str, **facts: Any) -> None:
        """How the job ends (leader only): ``done``, ``stopped``, ``gave_up`` or ``requeue``, with the exit code."""
        verdict = {"action": action, "code": code, "message": message, "time": time.time(), **facts}
        self.put(self.key("verdict"), verdict)
        self._tell(verdict=verdict)

    def verdict(self) -> dict[str, Any] | None:
        return self.read(self.key("verdict"))

    def set_token(self, token: str) -> None:
        self.put(self.key("ckpt_token"), {"token": token})

    def token(self) -> str | None:
        value = self.read(self.key("ckpt_token"))
        return None if value is None else str(value["token"])


@dataclass
class NodeWatch:
    """Which nodes went silent: a heartbeat that has not changed for ``timeout_s`` of *our* clock is stale."""

    timeout_s: float
    seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # node → (its beat's time, our time it changed)

    def observe(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        for node, beat in beats.items():
            stamp = float(beat.get("time", 0.0))
            if node not in self.seen or self.seen[node][0] != stamp:
                self.seen[node] = (stamp, now)

    def stale(self, nodes: Iterable[int], now: float, since: float) -> list[int]:
        """Nodes silent for longer than the timeout (a node never seen counts from ``since``)."""
        return [n for n in nodes if now - self.seen.get(n, (0.0, since))[1] > self.timeout_s]
