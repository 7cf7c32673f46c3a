"""--distributed-executor-backend ray without the cluster: what a user is told when Ray is missing
or the layout cannot work with it (the served path is in test_served_tp.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pagebus.bus.config import make_engine_config
from pagebus.bus.ray_executor import RayExecutorError, import_ray


def test_missing_ray_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayExecutorError, match=r"pip install 'pagebus\[ray\]'"):
        import_ray()


def test_ray_with_several_launchers_is_refused() -> None:
    with pytest.raises(ValueError, match="start only the head, without --nnodes"):
        make_engine_config(distributed_executor_backend="ray", nnodes=2, tensor_parallel_size=2)


def test_the_default_mp_path_never_imports_ray() -> None:
    assert make_engine_config().distributed_executor_backend == "mp"
    code = "import sys, pagebus.scheduler.main, pagebus.workers.main; print('ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False", out
