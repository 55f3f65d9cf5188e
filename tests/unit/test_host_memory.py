"""The worker's malloc tuning: applied on glibc, and an operator's own thresholds are left alone."""

import platform

import pytest

from pagedserve.worker_proc.host_memory import keep_freed_memory


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="mallopt thresholds are glibc's")
def test_thresholds_are_raised_on_glibc(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert keep_freed_memory() is True


@pytest.mark.parametrize("var", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_operator_thresholds_win(monkeypatch, var):
    monkeypatch.setenv(var, "131072")
    assert keep_freed_memory() is False
