"""sd_notify: one datagram per message to $NOTIFY_SOCKET (a path, or @name for an abstract socket).

A no-op when NOTIFY_SOCKET is unset, as under a terminal. Failures to send are logged once and
never raised: a daemon must not die because its supervisor's socket went away.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("pagebus.service")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET") or None
        if addr is not None and addr[0] == "@":
            addr = "\0" + addr[1:]  # abstract namespace
        self.address = addr
        self._sock: socket.socket | None = None
        self._warned = False
        self.watchdog_interval = _watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send `KEY=value` fields as one datagram; True when it went out."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %r failed: %s", self.address, e)
            return False

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets Type=notify-reload match this reload to the signal it sent.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading configuration")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval(env: dict[str, str] | os._Environ[str]) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC (sd_watchdog_enabled's rule), or None
    when no watchdog is armed for this process."""
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None  # meant for another process (e.g. a wrapper that exec'd us is not us)
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    return value / 2e6 if value > 0 else None
