"""Which of pagedserve's named functions a request passes through, recorded in each process.

Off unless ``PAGEDSERVE_CALL_TRACE`` names a directory (``tools/request_path.py`` sets it).
Then every process that starts from an entry point profiles its Python calls, and SIGUSR2
opens and closes a recording window: the first signal clears what was seen, the second writes
``<dir>/<pid>.json`` with each pagedserve function first called inside the window, in order.
The profile hook is installed for the whole process at start (Python 3.11 cannot reach threads
already running), so a traced deployment runs slower; nothing is installed without the variable.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

ENV = "PAGEDSERVE_CALL_TRACE"
_SUBPACKAGES = ("protocol", "scheduler_proc", "worker_proc", "frontend_proc", "kernels", "client", "offline", "deploy")
_SKIPPED = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<module>")


class _Recorder:
    def __init__(self, out_dir: Path, process_name: str):
        self.out_dir, self.process_name = out_dir, process_name
        self.dirs = _package_dirs()
        self.recording = False
        self.seen: dict[tuple[str, str], int] = {}

    def profile(self, frame, event, _arg) -> None:
        # Runs on every call of every thread: the cheap test first.
        if not self.recording or event != "call":
            return
        code = frame.f_code
        key = (code.co_filename, code.co_qualname)
        if key not in self.seen and code.co_name not in _SKIPPED and code.co_filename.startswith(self.dirs):
            self.seen[key] = len(self.seen)

    def toggle(self, _signum, _frame) -> None:
        if not self.recording:
            self.seen.clear()
            self.recording = True
            return
        self.recording = False
        calls = [[_short(path), qualname] for (path, qualname), _ in
                 sorted(self.seen.items(), key=lambda item: item[1]) if path != __file__]
        target = self.out_dir / f"{os.getpid()}.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps({"process": self.process_name, "pid": os.getpid(), "calls": calls}))
        tmp.rename(target)  # the tool waits for the file: it appears whole


def _package_dirs() -> tuple[str, ...]:
    """Where pagedserve's own code lives: the checkout's folders in an editable install, or
    site-packages/pagedserve; a library beside them is not pagedserve."""
    import importlib.util
    dirs = []
    for name in ("pagedserve",) + tuple(f"pagedserve.{sub}" for sub in _SUBPACKAGES):
        spec = importlib.util.find_spec(name)
        dirs += [os.path.join(d, "") for d in (spec.submodule_search_locations or [])]
    return tuple(dirs)


def _short(path: str) -> str:
    """``scheduler_proc/step.py`` rather than the absolute path."""
    parent = os.path.dirname(os.path.dirname(path))
    return os.path.relpath(path, parent)


def record_on_signal(process_name: str) -> None:
    """Called first by each process's entry point; does nothing unless ``PAGEDSERVE_CALL_TRACE`` is set."""
    out = os.environ.get(ENV)
    if not out:
        return
    recorder = _Recorder(Path(out), process_name)
    signal.signal(signal.SIGUSR2, recorder.toggle)
    sys.setprofile(recorder.profile)
    threading.setprofile(recorder.profile)
    (Path(out) / f"{os.getpid()}.ready").write_text(process_name)
