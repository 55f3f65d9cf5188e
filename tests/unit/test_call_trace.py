"""The call recorder behind tools/request_path.py: a SIGUSR2 window records pagedserve's named
functions first called inside it, in order, and nothing from outside the window or the package."""

from __future__ import annotations

import json
import os
import signal
import sys

from pagedserve import call_trace
from pagedserve.protocol.version import package_version
from pagedserve.tools.request_path import _summary


def test_a_window_records_the_package_functions_called_inside_it_in_order(tmp_path):
    recorder = call_trace._Recorder(tmp_path, "test")
    _summary([])  # before the window: not recorded (and tools/ is never on a request's path)
    previous = sys.getprofile()
    sys.setprofile(recorder.profile)
    try:
        recorder.toggle(signal.SIGUSR2, None)
        json.dumps({"x": 1})  # a library call: not pagedserve's
        call_trace._short("/a/b/c.py")  # the recorder's own module: left out
        _summary([["x.py", "A.f"]])  # tools/ is not on a request's path: left out
        package_version()
        recorder.toggle(signal.SIGUSR2, None)
    finally:
        sys.setprofile(previous)
    record = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert record["process"] == "test"
    names = [name for _, name in record["calls"]]
    assert names == ["package_version"]
    assert record["calls"][0][0] == os.path.join("protocol", "version.py")


def test_nothing_is_installed_without_the_variable(monkeypatch):
    monkeypatch.delenv(call_trace.ENV, raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    call_trace.record_on_signal("test")
    assert signal.getsignal(signal.SIGUSR2) is before
    assert sys.getprofile() is None or sys.getprofile() is not call_trace._Recorder.profile


def test_the_summary_counts_functions_their_classes_and_files():
    calls = [["a.py", "Engine.step"], ["a.py", "Engine.run"], ["b.py", "helper"], ["b.py", "f.<locals>.g"]]
    assert _summary(calls) == (4, 1, 2)
