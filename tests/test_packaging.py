"""One import name: the wheel installs `pagebus` and nothing else at the top level, and
Hugging Face's `kernels` package can live in the same environment."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The folders that install as pagebus.<folder>; each must carry every subpackage it has.
INTERNAL = ("bus", "scheduler", "workers", "frontends", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the venv's setuptools builds it, so the test needs no network.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    (whl,) = out.glob("pagebus-*.whl")
    return whl


def test_wheel_has_one_top_level_import_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pagebus"}, tops
    # Every package folder of the tree is in the wheel under its pagebus.<folder> name.
    for folder in INTERNAL:
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            assert f"pagebus/{rel}" in names, f"{rel} is missing from the wheel: list it in pyproject"
    assert not any(n.startswith(("pagebus/tests/", "pagebus/bench/")) for n in names)


def test_installed_wheel_imports_and_runs_without_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )  # fmt: skip
    code = (
        "import sys, pagebus, pagebus.bus.messages, pagebus.scheduler.scheduler;"
        "assert pagebus.__file__.startswith(sys.argv[1]), pagebus.__file__;"
        "assert pagebus.__path__ == [sys.argv[1] + '/pagebus'], pagebus.__path__;"
        "from pagebus import LLM, SamplingParams; assert SamplingParams(max_tokens=3).max_tokens == 3;"
        "assert 'torch' not in sys.modules or LLM"
    )
    # -I: isolated, so neither the cwd (the repo) nor the editable install is on the path.
    site = subprocess.run(
        [sys.executable, "-I", "-c", "import site, sys; print(site.getsitepackages()[0])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env = {"PYTHONPATH": f"{target}{os.pathsep}{site}", "PATH": os.environ.get("PATH", "")}
    subprocess.run(
        [sys.executable, "-S", "-c", code, str(target)], cwd=tmp_path, env=env, check=True, timeout=120
    )


@pytest.mark.slow
def test_hugging_face_kernels_package_coexists(tmp_path: Path, default_model: str) -> None:
    """`kernels` is the kernel-hub package's name: it must stay theirs, and pagebus must still run."""
    target = tmp_path / "hf"
    got = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "kernels"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if got.returncode != 0:
        pytest.fail(f"could not install Hugging Face's kernels package from PyPI: {got.stderr[-2000:]}")
    env = {**os.environ, "PYTHONPATH": str(target)}
    theirs = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert theirs.stdout.strip().startswith(str(target)), theirs.stdout + theirs.stderr
    gen = subprocess.run(
        [sys.executable, "-m", "pagebus.frontends.cli", "generate", "The capital of France is",
         "--max-tokens", "4", "--dtype", "float32", "--log-level", "WARNING"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip(), gen.stderr[-3000:]
