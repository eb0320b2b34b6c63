"""Free loopback ports for the servers the tests start.

Ray's workers take ports 10002-19999 by default, and ports from the kernel's ephemeral range go to every
outgoing connection and port-0 listener (a Ray cluster opens dozens while it starts): a free port from
either can be taken between the test picking it and its server binding it. So the ports come from
between the two."""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORTS_FROM = 20000  # above Ray's worker ports


def free_port() -> int:
    """A free loopback TCP port between Ray's worker ports and the kernel's ephemeral range."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    below = int(ephemeral.read_text().split()[0]) if ephemeral.is_file() else 32768
    rng = random.Random()  # seeded from the OS: xdist workers and scenario processes draw different ports
    for _ in range(500):
        port = rng.randrange(PORTS_FROM, below)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 between {PORTS_FROM} and {below}")
