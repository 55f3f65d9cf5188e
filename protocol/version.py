"""The installed pagedserve version, for `pagedserve --version` and the frontend's /version."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
