"""`pagebus systemd-unit [serve flags]`: a systemd service unit that runs `pagebus serve` with
those flags as a notify daemon, with a watchdog and a sandbox as tight as the engine allows.

Sandbox notes: torch and Triton JIT-compile (no MemoryDenyWriteExecute); the engine's processes
talk over AF_UNIX sockets in $XDG_RUNTIME_DIR (RuntimeDirectory=); Triton's and HF's caches go to
CacheDirectory= (pagebus's own: converted tokenizers and weights as held, under
XDG_CACHE_HOME). On NVIDIA boxes the device nodes are allowed by their /proc/devices group names
(`char-nvidia-frontend` covers /dev/nvidia0..N, /dev/nvidiactl and /dev/nvidia-modeset;
`char-nvidia-uvm` the unified memory nodes; `char-nvidia-caps` the MIG capability nodes), so the
unit does not depend on how many GPUs the box has.
"""

from __future__ import annotations

import argparse
import grp
import os
import sys
from collections.abc import Sequence

DEFAULT_ENV_FILE = "/etc/pagebus/pagebus.env"
# Options of systemd-unit itself; everything else on its command line goes to ExecStart.
UNIT_ONLY = ("--service-user", "--environment-file", "--devices", "--watchdog-sec", "--description")
GPU_GROUPS = ("video", "render")  # distributions that do not make /dev/nvidia* world-accessible


def add_unit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("unit")
    g.add_argument("--service-user", default="pagebus", help="dedicated user the service runs as")
    g.add_argument(
        "--environment-file", default=DEFAULT_ENV_FILE, help="e.g. PAGEBUS_API_KEY=... (mode 0600)"
    )
    g.add_argument(
        "--devices",
        choices=["auto", "gpu", "cpu"],
        default="auto",
        help="auto: gpu when /dev/nvidiactl exists",
    )
    g.add_argument(
        "--watchdog-sec", type=float, default=30.0, help="WatchdogSec: restart this long after the last ping"
    )
    g.add_argument("--description", default=None)


def serve_argv(argv: Sequence[str]) -> list[str]:
    """The serve flags among systemd-unit's arguments (the unit's own options removed)."""
    out: list[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in UNIT_ONLY:
            skip = "=" not in tok
            continue
        out.append(tok)
    return out


def _quote(word: str) -> str:
    """One ExecStart word: `$` and `%` escaped for systemd; quoted when it has spaces or quotes."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not any(c in word for c in " \t\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _executable() -> list[str]:
    script = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "pagebus")
    if os.access(script, os.X_OK):
        return [script]
    return [os.path.abspath(sys.executable), "-m", "pagebus.frontends.cli"]


def _uses_gpu(args: argparse.Namespace) -> bool:
    if args.devices != "auto":
        return bool(args.devices == "gpu")
    device = getattr(args, "device", None) or "auto"
    if device.startswith("cuda"):
        return True
    return device == "auto" and os.path.exists("/dev/nvidiactl")


def _seconds(value: float) -> str:
    return f"{max(1, round(value))}s"


def render_unit(args: argparse.Namespace, flags: Sequence[str]) -> str:
    if getattr(args, "api_key", None) and "--api-key" in {f.split("=", 1)[0] for f in flags}:
        raise ValueError(
            "--api-key would be readable in the unit and in `ps`: put PAGEBUS_API_KEY=... in "
            f"{args.environment_file} (mode 0600) or use --api-key-file"
        )
    exe = [*_executable(), "serve", *flags]
    gpu = _uses_gpu(args)
    paths = [exe[0], getattr(args, "model", None) or "", getattr(args, "api_key_file", None) or ""]
    under_home = any(p.startswith(("/home/", "/root/")) for p in paths)
    desc = (args.description or "pagebus OpenAI-compatible LLM server").replace("%", "%%")
    lines = [
        "# Written by `pagebus systemd-unit`; install as /etc/systemd/system/pagebus.service",
        "[Unit]",
        f"Description={desc}",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "# Only the main process sends READY/WATCHDOG/STOPPING; the engine's children never do.",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(_quote(w) for w in exe),
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "RestartSec=5s",
        "# Model load and KV allocation happen before READY=1.",
        f"TimeoutStartSec={_seconds(args.startup_timeout + 60)}",
        "# SIGTERM drains in-flight requests for up to --drain-timeout, then the engine stops.",
        f"TimeoutStopSec={_seconds(args.drain_timeout + 30)}",
        "# Pings stop when the engine stalls (--stall-timeout); systemd restarts it after this.",
        f"WatchdogSec={_seconds(args.watchdog_sec)}",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        f"User={args.service_user}",
        f"Group={args.service_user}",
        f"EnvironmentFile=-{args.environment_file}",
        "Environment=PYTHONUNBUFFERED=1",
        "Environment=HOME=/var/lib/pagebus",
        "Environment=XDG_CACHE_HOME=/var/cache/pagebus",
        "Environment=TRITON_CACHE_DIR=/var/cache/pagebus/triton",
        "Environment=XDG_RUNTIME_DIR=/run/pagebus",
        "StateDirectory=pagebus",
        "CacheDirectory=pagebus",
        "RuntimeDirectory=pagebus",
        "RuntimeDirectoryMode=0700",
        "ReadWritePaths=/var/lib/pagebus /var/cache/pagebus /run/pagebus",
        "LimitNOFILE=65536",
    ]
    if gpu:
        lines += ["# Pinned host buffers for the GPU copies.", "LimitMEMLOCK=infinity"]
    lines += [
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        # A venv or model under /home must stay readable.
        f"ProtectHome={'read-only' if under_home else 'yes'}",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "RestrictNamespaces=yes",
        "LockPersonality=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "SystemCallArchitectures=native",
        "UMask=0077",
    ]
    if gpu:
        lines += [
            "# NVIDIA device nodes only: GPUs, nvidiactl and modeset, UVM, MIG capabilities.",
            "PrivateDevices=no",
            "DevicePolicy=closed",
            "DeviceAllow=char-nvidia-frontend rw",
            "DeviceAllow=char-nvidia-uvm rw",
            "DeviceAllow=char-nvidia-caps r",
        ]
        groups = [g for g in GPU_GROUPS if _group_exists(g)]
        if groups:
            lines.append("SupplementaryGroups=" + " ".join(groups))
    else:
        lines.append("PrivateDevices=yes")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False
