"""The process boundaries hold: import-linter checks pyproject's [tool.importlinter] contracts
(a process package imports its own package and protocol, plus kernels for the worker and client
for the frontend; protocol imports no other package; client only protocol; offline client,
protocol and the launcher).

import-linter finds a package's modules by walking its folder, but ours install from several
top-level folders (pyproject's package-dir), so the check runs on a copy laid out as installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _installed_layout(target: Path) -> Path:
    """Copies each package's .py files to where it installs (pagedserve/, pagedserve/protocol/, ...)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        dest = target.joinpath(*package.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / folder).glob("*.py"):
            shutil.copy(source, dest / source.name)
    return target


@pytest.mark.slow  # lint-imports runs in its own process, on the copy
def test_the_import_contracts_in_pyproject_hold(tmp_path):
    pytest.importorskip("importlinter")
    layout = _installed_layout(tmp_path / "layout")
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint), str(ROOT / "pyproject.toml"), "--no-cache"], cwd=layout,
                         env={"PYTHONPATH": str(layout), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def test_every_installed_package_is_in_the_copy_the_contracts_check():
    """A package left out of package-dir would escape every contract."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(setuptools["packages"]) == set(setuptools["package-dir"])
