"""Free TCP ports for the tests and benches that start servers, picked below the kernel's ephemeral range.

A port from `bind(("127.0.0.1", 0))` lies in the ephemeral range, where the kernel also picks the
local ports of outgoing connections and of every other `bind(0)`: between the pick and the
server's own bind, the engine's processes (gloo's pairs, the bus's sockets) can take it, and
the server then dies with "address already in use". Below that range only an explicit bind can
take a port, so a port checked free here stays free. The floor keeps clear of Ray's default
worker ports (10002-19999), which `ray start --head` refuses for its own GCS port.
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_FLOOR = 20000


def _ephemeral_low() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default low end


def free_port(n: int = 1) -> int:
    """A port p with p .. p + n - 1 all free on the loopback, outside the ephemeral range."""
    high = _ephemeral_low() - n
    for _ in range(200):
        base = random.randint(_FLOOR, high)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports between {_FLOOR} and {high + n}")
