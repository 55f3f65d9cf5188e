"""Building the native CPU kernels (kernels/cpu_native.py) runs a compiler: a compiler that fails
leaves the torch path and no half-built library; a fresh cache builds one that loads."""

from __future__ import annotations

import logging

import pytest

from pagedserve.kernels import cpu_native


@pytest.mark.slow
def test_a_compiler_that_fails_means_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # exists, and fails whatever it is asked
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path / "kernels"))
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels"):
        assert cpu_native._build() is None
    assert list((tmp_path / "kernels").iterdir()) == []  # no half-built library left behind


@pytest.mark.slow
def test_a_fresh_cache_builds_a_library_that_loads(monkeypatch, tmp_path):
    if cpu_native.library() is None:
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv(cpu_native.CACHE_ENV, str(tmp_path / "kernels"))
    assert cpu_native._build() is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
