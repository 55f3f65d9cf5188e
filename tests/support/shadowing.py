"""A working directory that shadows an installed package, as a clone's root does: its kernels/
folder has the name of Hugging Face's ``kernels``, which transformers imports to read a Llama
config. A process that puts its working directory on ``sys.path`` fails there."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READS_A_LLAMA_CONFIG = "import transformers.models.llama.configuration_llama"


def shadowing_cwd(tmp: Path) -> Path:
    """The repository root where ``kernels`` is installed (transformers requires it); where it is
    not, a directory holding a stand-in ``kernels`` distribution whose package raises on import,
    so the same mistake fails the same way."""
    try:
        importlib.metadata.version("kernels")
        return ROOT
    except importlib.metadata.PackageNotFoundError:
        from transformers.utils.import_utils import KERNELS_MIN_VERSION

        standin = tmp / "shadowing-cwd"
        (standin / "kernels").mkdir(parents=True, exist_ok=True)
        (standin / "kernels" / "__init__.py").write_text("raise ImportError('the stand-in kernels was imported')\n")
        info = standin / f"kernels-{KERNELS_MIN_VERSION}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {KERNELS_MIN_VERSION}\n")
        return standin


def unsafe_env(**extra: str | None) -> dict[str, str | None]:
    """Overrides that undo the suite's own PYTHONSAFEPATH (tests/conftest.py): the engine must not
    depend on its caller's environment to start clean."""
    return {"PYTHONSAFEPATH": None, **extra}


def environ(overrides: dict[str, str | None]) -> dict[str, str]:
    return {k: v for k, v in {**os.environ, **overrides}.items() if v is not None}


def assert_it_shadows(cwd: Path) -> None:
    """The trap is set: a plain ``python -c`` started there cannot read a Llama config."""
    probe = subprocess.run([sys.executable, "-c", READS_A_LLAMA_CONFIG], cwd=cwd, env=environ(unsafe_env()),
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and "kernels" in probe.stderr, probe.stderr[-2000:]
