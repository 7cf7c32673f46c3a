"""`pagebus systemd-unit`: the unit for several flag sets passes `systemd-analyze verify` without a
warning, and carries what the flags imply (timeouts, watchdog, sandbox, NVIDIA devices)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from pagebus.frontends.cli import main

FLAG_SETS = {
    "defaults": [],
    "cpu": ["--port", "8080", "--max-model-len", "4096", "--drain-timeout", "120", "--devices", "cpu"],
    "nvidia": ["--devices", "gpu", "--model", "/srv/models/llama 3.gguf", "--gpu-memory-utilization", "0.85"],
    "service": [
        "--service-user", "llm", "--environment-file", "/etc/llm.env", "--watchdog-sec", "45",
        "--api-key-file", "/etc/pagebus/key", "--log-format", "json", "--stall-timeout", "90",
        "--description", "LLM 100% $HOME", "--host", "0.0.0.0",
    ],
}  # fmt: skip


def unit_for(flags: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["systemd-unit", *flags]) == 0
    return capsys.readouterr().out


def entries(unit: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


@pytest.mark.parametrize("name", sorted(FLAG_SETS))
def test_unit_passes_systemd_analyze_verify(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (`make setup` installs Debian's systemd when root)")
    path = tmp_path / "pagebus.service"
    path.write_text(unit_for(FLAG_SETS[name], capsys))
    res = subprocess.run(
        ["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr


def test_unit_content_follows_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    e = entries(unit_for(FLAG_SETS["cpu"], capsys))
    assert e["Type"] == ["notify"] and e["NotifyAccess"] == ["main"] and e["KillMode"] == ["mixed"]
    assert e["ExecStart"][0].endswith("serve --port 8080 --max-model-len 4096 --drain-timeout 120")
    assert e["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and e["Restart"] == ["on-failure"]
    assert e["TimeoutStopSec"] == ["150s"] and e["TimeoutStartSec"] == ["660s"]  # drain + 30, start + 60
    assert (
        e["User"] == ["pagebus"] and e["ProtectSystem"] == ["strict"] and e["CapabilityBoundingSet"] == [""]
    )
    assert e["PrivateDevices"] == ["yes"] and "DeviceAllow" not in e and "LimitMEMLOCK" not in e

    g = entries(unit_for(FLAG_SETS["nvidia"], capsys))
    assert g["ExecStart"][0].endswith(
        'serve --model "/srv/models/llama 3.gguf" --gpu-memory-utilization 0.85'
    )
    assert g["DevicePolicy"] == ["closed"] and g["LimitMEMLOCK"] == ["infinity"]
    assert set(g["DeviceAllow"]) == {"char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps r"}

    s = entries(unit_for(FLAG_SETS["service"], capsys))
    assert s["User"] == ["llm"] and s["EnvironmentFile"] == ["-/etc/llm.env"] and s["WatchdogSec"] == ["45s"]
    assert s["Description"] == ["LLM 100%% $HOME"]  # % escaped; $ is literal outside ExecStart
    assert "--watchdog-sec" not in s["ExecStart"][0] and "--stall-timeout 90" in s["ExecStart"][0]


def test_api_key_on_the_command_line_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["systemd-unit", "--api-key", "sk-secret"]) == 2
    err = capsys.readouterr().err
    assert "PAGEBUS_API_KEY" in err and "sk-secret" not in err
