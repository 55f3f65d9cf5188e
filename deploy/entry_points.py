"""The Python processes a deployment starts, as command lines: pagedserve's own entry points,
importing what is installed and never what sits in the working directory.

``python -m`` puts the working directory first on ``sys.path``, and the repository's top-level
folders share names with installed packages (``kernels/`` is Hugging Face's ``kernels``, which
transformers imports for every Llama config): a deployment started from a clone's root imported
the folder instead. ``-P`` (3.11+) leaves that entry out; on 3.10 each entry point drops it
itself first (``pagedserve.clean_path``). The fork server runs only ``ENTRY_MODULES``.
"""

from __future__ import annotations

import sys
from typing import Optional

# What the launcher asks the fork server for: a replica's scheduler, a device's worker, the frontend.
ENTRY_MODULES = frozenset({"pagedserve.scheduler_proc", "pagedserve.worker_proc", "pagedserve.frontend_proc"})

SAFE_PATH_FLAGS = ("-P",) if sys.version_info >= (3, 11) else ()


def python_module(module: str, *args: str) -> list[str]:
    """``python -P -m module args...`` with this interpreter."""
    return [sys.executable, *SAFE_PATH_FLAGS, "-m", module, *args]


def module_of(argv: list[str]) -> Optional[str]:
    """The module ``argv`` runs, if it is ``[python, (-P,) -m, module, ...]``; else None."""
    rest = argv[1:]
    if rest[:1] == ["-P"]:
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return rest[1]
    return None


def arguments_of(argv: list[str]) -> list[str]:
    """What the module of such a command line is given: the arguments after its name."""
    return argv[argv.index("-m") + 2:]
