"""Beyond one node, rehearsed on loopback: internal endpoints on TCP with CurveZMQ forced on,
and the workers started by hand from a copy of only what a worker node needs."""

from __future__ import annotations

import glob
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from support.oracle import hf_tokenizer
from support.server import Server, free_port_range
from support.greedy import assert_equal_to_transformers, greedy_completions

WORKER_NODE_FILES = ["endpoints.json", "curve/server.key", "curve/client.key_secret"]


class RemoteWorkers(threading.Thread):
    """Plays the operator on the worker node: waits for the head's worker-commands.sh, copies
    the files a worker node needs, and runs the commands against that copy."""

    def __init__(self, run_dir_parent: Path, worker_node: Path, log_path: Path, num_workers: int):
        super().__init__(daemon=True)
        self.run_dir_parent, self.worker_node, self.log_path = run_dir_parent, worker_node, log_path
        self.num_workers = num_workers
        self.procs: list[subprocess.Popen] = []
        self.head_run_dir: Path | None = None
        self.stopping = threading.Event()  # a failed start must not leave workers started after the test ended

    def run(self) -> None:
        deadline = time.monotonic() + 120
        lines: list[str] = []
        while len(lines) < self.num_workers:
            if time.monotonic() > deadline or self.stopping.wait(0.1):  # polling for a file another process writes
                return
            found = glob.glob(str(self.run_dir_parent / "pagedserve-*" / "worker-commands.sh"))
            lines = Path(found[0]).read_text().splitlines() if found else []
        self.head_run_dir = Path(found[0]).parent
        for name in WORKER_NODE_FILES:
            (self.worker_node / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            shutil.copy(self.head_run_dir / name, self.worker_node / name)
        log = open(self.log_path, "wb")
        for line in lines:
            if self.stopping.is_set():
                return
            argv = shlex.split(line.rstrip("& "))
            argv[argv.index("--run-dir") + 1] = str(self.worker_node)
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

    def stop(self) -> list[int]:
        self.stopping.set()
        self.join(130)
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(30))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


@pytest.mark.slow
def test_tcp_curve_deployment_with_workers_started_by_hand_serves_transformers_greedy_tokens(
        model_factory, tmp_path):
    model = model_factory("qwen2")
    base = free_port_range(2 + 1 * 2)
    srv = Server(model, ["--num-gpu-blocks", "64", "--max-model-len", "512", "--tensor-parallel-size", "2",
                         "--internal-host", "127.0.0.1", "--internal-port-base", str(base),
                         "--internal-curve", "--remote-workers"])
    worker_node = tmp_path / "worker-node"
    workers = RemoteWorkers(tmp_path / "run", worker_node, tmp_path / "workers.log", num_workers=2)
    workers.start()
    try:
        srv.start(tmp_path)
        head = workers.head_run_dir
        assert not list(head.glob("*.sock"))  # every internal endpoint is on TCP
        assert sorted(str(p.relative_to(worker_node)) for p in worker_node.rglob("*") if p.is_file()) == \
            sorted(WORKER_NODE_FILES)  # the worker node never saw the server's secret key
        tok = hf_tokenizer(model)
        prompts = [tok(p).input_ids for p in ("Hello, world!", "The quick brown fox jumps over the lazy dog")]
        assert_equal_to_transformers(model, prompts, greedy_completions(srv, prompts, 10), 10)
    finally:
        codes = workers.stop()
        srv.stop()
    assert codes == [0, 0], (tmp_path / "workers.log").read_text()[-3000:]
    assert srv.proc.returncode == 0


def test_a_non_loopback_internal_host_turns_curve_on_and_half_an_address_is_refused(model_factory):
    from pagedserve.deploy.serve_config import ConfigError, ServeConfig

    model = model_factory("qwen2")
    wide = ServeConfig(model=model, internal_host="10.0.0.7", internal_port_base=31000, data_parallel_size=2)
    assert wide.uses_curve and wide.tcp_layout().num_ports() == 6
    assert not ServeConfig(model=model, internal_host="127.0.0.1", internal_port_base=31000).uses_curve
    with pytest.raises(ConfigError, match="go together"):
        ServeConfig(model=model, internal_host="10.0.0.7")
    with pytest.raises(ConfigError, match="needs --internal-host"):
        ServeConfig(model=model, internal_curve=True)
    with pytest.raises(ConfigError, match="not all TCP ports"):
        ServeConfig(model=model, internal_host="127.0.0.1", internal_port_base=65533)
