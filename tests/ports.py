"""Ports for the servers and process groups that tests start.

A port found by binding port 0 and closing it is an *ephemeral* port: until the test's process binds it
again, any outgoing connection on the machine (gloo opens dozens per group) may be given it, and the test
fails with EADDRINUSE. These ports come from below the kernel's ephemeral range instead, where only a
process that binds a chosen port can take them, and each is probed (with the ``span - 1`` after it: a
job's store takes the rendezvous port + 1) before it is handed out.
"""

from __future__ import annotations

import random
import socket

BELOW_EPHEMERAL = (20000, 32000)  # Linux's ephemeral range starts at 32768 (net.ipv4.ip_local_port_range)


def free_port(span: int = 2) -> int:
    """A port on 127.0.0.1 free now, with the ``span - 1`` ports after it."""
    while True:
        port = random.randrange(BELOW_EPHEMERAL[0], BELOW_EPHEMERAL[1] - span)
        probes = [socket.socket() for _ in range(span)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
