"""How a runtime process ends once it has closed what it owns: without the interpreter's teardown.

Finalization collects every object the process still holds, and with torch, transformers and
xgrammar loaded (frozen by ``gc.freeze`` at start) a scheduler spent ~0.8 s of its stop in that
collection and in torch's operator deregistration (py-spy, demo model, 2 cores: bench/log/2026-11-27.md
"Stopping a deployment"). Nothing left needs it: the caller has closed its sockets and files.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flush the logs and standard streams, then end the process with ``code``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe has nothing left to flush
            pass
    os._exit(code)
