"""Beside the HTTP server, one task ticks: stall detection, watchdog pings, the periodic stats line
and the STATUS= summary systemd shows.

The watchdog is fed only while the engine makes progress (or has nothing to do): once a stall is
seen, pings stop and systemd restarts the service after WatchdogSec. The HTTP process's own
liveness is covered too, since a wedged event loop sends no pings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pagebus.bus.messages import SchedulerStats
from pagebus.frontends.service.notify import Notifier
from pagebus.frontends.service.progress import ProgressTracker
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("pagebus.stats")
TICK_S = 0.1


class Supervisor:
    def __init__(
        self,
        stats: Callable[[], SchedulerStats | None],
        busy: Callable[[], bool],
        notifier: Notifier,
        registry: CollectorRegistry,
        *,
        stall_timeout: float,
        stats_interval: float,
    ) -> None:
        self.stats, self.busy, self.notifier, self.registry = stats, busy, notifier, registry
        self.progress = ProgressTracker(stall_timeout)
        self.stats_interval = stats_interval
        self.stalls = Counter(
            "pagebus:engine_stalls",
            "Times the engine had work but finished no step for --stall-timeout seconds",
            registry=registry,
        )
        self.stalled_gauge = Gauge(
            "pagebus:engine_stalled", "1 while the engine is stalled, else 0", registry=registry
        )
        self.stalled = False
        self.pinging = False  # from READY=1 on: systemd's watchdog runs from then
        now = time.monotonic()
        self._next_ping = now
        self._next_stats = now + stats_interval
        self._last_tokens = self._tokens()
        self._last_status: str | None = None

    # ------------------------------------------------------------------ what /health asks
    def stall_reason(self, now: float | None = None) -> str | None:
        """Why the engine counts as stalled now, or None; observes the latest step first."""
        now = time.monotonic() if now is None else now
        s = self.stats()
        self.progress.observe(s.num_steps if s is not None else None, self.busy(), now)
        idle = self.progress.stalled_for(now)
        if idle is None:
            return None
        return (
            f"engine stalled: requests in flight but no engine step finished for {idle:.1f}s "
            f"(stall timeout {self.progress.stall_timeout:g}s)"
        )

    # ------------------------------------------------------------------ the tick
    def tick(self, now: float) -> None:
        reason = self.stall_reason(now)
        if reason is not None and not self.stalled:
            self.stalled = True
            self.stalls.inc()
            self.stalled_gauge.set(1)
            log.error("%s; watchdog pings stop", reason)
            self._status(f"STALLED: {reason}")
        elif reason is None and self.stalled:
            self.stalled = False
            self.stalled_gauge.set(0)
            log.warning("engine making progress again; watchdog pings resume")
        interval = self.notifier.watchdog_interval
        if interval is not None and self.pinging and not self.stalled and now >= self._next_ping:
            self.notifier.watchdog()
            self._next_ping = now + interval
        if self.stats_interval > 0 and now >= self._next_stats:
            self._stats_line(now, reason)

    async def run(self, should_exit: Callable[[], bool]) -> None:
        while not should_exit():
            self.tick(time.monotonic())
            await asyncio.sleep(TICK_S)

    def reset_stats_interval(self, interval: float) -> None:
        self.stats_interval = interval
        self._next_stats = time.monotonic() + interval

    # ------------------------------------------------------------------ stats
    def _tokens(self) -> tuple[float, float]:
        get = self.registry.get_sample_value
        return (get("pagebus:prompt_tokens_total") or 0.0, get("pagebus:generation_tokens_total") or 0.0)

    def _stats_line(self, now: float, reason: str | None) -> None:
        elapsed = self.stats_interval + (now - self._next_stats)
        self._next_stats = now + self.stats_interval
        tokens = self._tokens()
        prompt_tps = (tokens[0] - self._last_tokens[0]) / elapsed
        gen_tps = (tokens[1] - self._last_tokens[1]) / elapsed
        moved = tokens != self._last_tokens
        self._last_tokens = tokens
        s = self.stats() or SchedulerStats()
        busy = self.busy() or s.num_running > 0 or s.num_waiting > 0
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        summary = (
            f"running {s.num_running}, waiting {s.num_waiting}, KV {100 * s.kv_usage:.1f}%, "
            f"generation {gen_tps:.1f} tok/s"
        )
        self._status(f"STALLED: {reason}" if reason else f"serving: {summary}" if busy else "idle")
        if not (busy or moved or reason):
            return
        fields: dict[str, object] = {
            "prompt_tps": round(prompt_tps, 2),
            "generation_tps": round(gen_tps, 2),
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_usage": round(s.kv_usage, 4),
            "prefix_hit_rate": round(hit, 4),
            "preemptions": s.num_preemptions,
            "steps": s.num_steps,
            "stalled": reason is not None,
        }
        spec = ""
        if s.spec_num_draft_tokens:  # speculative decoding, cumulative
            rate = s.spec_num_accepted_tokens / s.spec_num_draft_tokens
            mean = 1.0 + s.spec_num_accepted_tokens / s.spec_num_drafts
            per_pos = [
                round(a / d, 3) if d else 0.0
                for a, d in zip(s.spec_accepted_per_position, s.spec_drafted_per_position, strict=True)
            ]
            fields.update(
                spec_acceptance_rate=round(rate, 4), spec_mean_accepted_length=round(mean, 3),
                spec_acceptance_per_position=per_pos,
            )  # fmt: skip
            spec = f", spec acceptance {100 * rate:.1f}% {per_pos}, mean accepted length {mean:.2f}"
        log.info(
            "stats: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV %.1f%%, "
            "prefix hit %.1f%%, preemptions %d%s%s",
            prompt_tps, gen_tps, s.num_running, s.num_waiting, 100 * s.kv_usage, 100 * hit,
            s.num_preemptions, spec, f"; STALLED ({reason})" if reason else "",
            extra={"stats": fields},
        )  # fmt: skip

    def _status(self, text: str) -> None:
        if text != self._last_status:
            self._last_status = text
            self.notifier.status(text)
