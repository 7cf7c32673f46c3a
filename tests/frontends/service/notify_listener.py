"""A test-owned sd_notify socket: a datagram socket whose messages are kept with their arrival time."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable


class NotifyListener:
    def __init__(self, path: str, on_message: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.on_message = on_message
        self.cond = threading.Condition()
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="notify-listener", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            msg = data.decode()
            if self.on_message is not None:
                self.on_message(msg)  # before it is visible: what the listener saw at that moment
            with self.cond:
                self.messages.append((time.monotonic(), msg))
                self.cond.notify_all()

    def wait_for(self, field: str, after: float = 0.0, timeout: float = 60.0) -> float:
        """Arrival time of the first message carrying `field` (e.g. "READY=1") after `after`."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, m in self.messages:
                    if t > after and field in m.split("\n"):
                        return t
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {field} within {timeout}s; got {self.messages[-10:]}")
                self.cond.wait(left)

    def times(self, field: str, since: float = 0.0, until: float = float("inf")) -> list[float]:
        with self.cond:
            return [t for t, m in self.messages if since < t <= until and field in m.split("\n")]

    def close(self) -> None:
        self._stop = True
        self.thread.join(2.0)
        self.sock.close()
        os.unlink(self.path)
