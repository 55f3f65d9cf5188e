"""The first thing each of pagedserve's entry points does: drop the working directory that
``python -m`` put first on ``sys.path`` (Python 3.10, which has no ``-P``; see
``pagedserve.deploy.entry_points``), before anything imports transformers, which imports
Hugging Face's ``kernels`` — a name the repository's own ``kernels/`` folder would shadow."""

from __future__ import annotations

import os
import sys


def drop_working_directory() -> None:
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        return
    first = sys.path[0]
    if first == "" or os.path.realpath(first) == os.path.realpath(os.getcwd()):
        del sys.path[0]
