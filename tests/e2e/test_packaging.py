"""The folders install under one namespace, both as a wheel and editable."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["protocol", "scheduler_proc", "worker_proc", "frontend_proc", "kernels", "deploy"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True)
    return next(out.glob("pagedserve-*.whl"))


@pytest.mark.slow  # pip builds the wheel in a subprocess
def test_the_wheel_puts_nothing_but_pagedserve_in_site_packages(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pagedserve", wheel.name.split("-py")[0] + ".dist-info"}
    for pkg in PACKAGES:
        assert f"pagedserve/{pkg}/__init__.py" in names
    assert "pagedserve/worker_proc/models/causal_lm.py" in names
    assert "pagedserve/kernels/cpu_decode_attention.c" in names  # compiled where it runs
    assert "pagedserve/__init__.py" in names  # `from pagedserve import LLM, SamplingParams`
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"pagedserve = pagedserve.deploy.cli:main" in entry_points


@pytest.mark.slow
def test_an_installed_wheel_imports_every_package_from_site_packages(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    deps = sysconfig.get_paths()["purelib"]
    # -S: no .pth files, so the editable install of this checkout cannot shadow the wheel
    code = (f"import sys; sys.path[:0] = [{str(target)!r}, {deps!r}]\n"
            + "".join(f"import pagedserve.{p}\n" for p in PACKAGES)
            + "from pagedserve import LLM, SamplingParams\n"
            + "import pagedserve.frontend_proc.app\n"  # imports every subpackage of the frontend
            + "import pagedserve.deploy.cli as c; print(c.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip().startswith(str(target))


@pytest.mark.slow  # a fresh interpreter: the import graph of this one is already polluted
def test_importing_the_protocol_does_not_load_the_offline_api():
    code = "import sys, pagedserve.protocol.messages; print('pagedserve.offline.llm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_the_editable_install_maps_each_folder_into_the_namespace():
    import pagedserve.kernels.reference
    import pagedserve.protocol

    assert Path(pagedserve.protocol.__file__).parent == ROOT / "protocol"
    assert Path(pagedserve.kernels.reference.__file__).parent == ROOT / "kernels"


# setuptools installs only the packages pyproject lists: a subpackage added without its entry
# works editable and in the suite, and fails at import once installed from a wheel
# (frontend_proc/reasoning did: a wheel install's frontend could not start).
def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_with_an_init_under_a_package_is_listed_for_the_wheel():
    package_dir = _setuptools()["package-dir"]
    listed = set(package_dir.values())
    missing = []
    for top in ("api", *{folder.split("/")[0] for folder in listed}):
        for init in (ROOT / top).rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT).as_posix()
            if "__pycache__" not in folder and folder not in listed:
                missing.append(folder)
    assert not missing, f"pyproject's [tool.setuptools] lacks these package folders: {missing}"


def test_every_listed_package_has_its_folder():
    setuptools = _setuptools()
    assert sorted(setuptools["packages"]) == sorted(setuptools["package-dir"])
    for name, folder in setuptools["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{name}: {folder} has no __init__.py"
