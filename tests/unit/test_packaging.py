"""A wheel (a non-editable install) carries every package folder of the checkout.

setuptools installs only the packages pyproject lists, so a subpackage added without its
entry works in the editable checkout and the suite, and fails at import once installed from
a wheel (frontend_proc/reasoning did: the frontend of a wheel install could not start).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
