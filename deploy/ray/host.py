"""The Ray actor that runs one placement-group bundle's process on its node.

A replica's scheduler and each of its workers get one ``ProcessHost`` each, pinned to
their bundle. The host starts the very command line the local supervisor would run
(deploy/serve_config.py), with ``--run-dir`` pointing at a private 0700 directory it
makes on its own node and fills with the files the supervisor sent through Ray (the
endpoint layout and the CURVE keys that process needs): no shared filesystem. The child
gets a parent-death signal (deploy/children.py), so when the actor dies, killed or with
its node, the child dies too.

This module imports Ray only inside ``remote_class()``: the package must import without it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Optional

from pagedserve.deploy.children import free_tcp_port, spawn
from pagedserve.protocol.zmq_io import make_run_dir


class ProcessHost:
    def __init__(self, model: str, run_dir_parent: Optional[str]):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.model = model
        self.run_dir_parent = run_dir_parent
        self.run_dir: Optional[Path] = None
        self.popen: Optional[subprocess.Popen] = None

    def where(self, num_ports: int = 0) -> dict:
        """This node, whether it has the model, and free TCP ports on its address."""
        return {"node_id": self.node_id, "ip": self.ip, "hostname": socket.gethostname(),
                "has_model": (Path(self.model) / "config.json").is_file(),
                "ports": [free_tcp_port(self.ip) for _ in range(num_ports)]}

    def start(self, cmd: list[str], files: dict[str, bytes]) -> int:
        """(Re)start the process with ``files`` (relative path -> bytes) in a fresh run dir; its pid."""
        self.stop(0.0)
        self.run_dir = make_run_dir(self.run_dir_parent if self.run_dir_parent and
                                    os.path.isdir(self.run_dir_parent) else None)
        for rel, data in files.items():
            path = self.run_dir / rel
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        cmd = list(cmd)
        cmd[cmd.index("--run-dir") + 1] = str(self.run_dir)
        self.popen = spawn("ray-hosted", 0, 0, cmd).popen
        return self.popen.pid

    def poll(self) -> Optional[int]:
        return None if self.popen is None else self.popen.poll()

    def stop(self, grace_s: float) -> Optional[int]:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit code (None if never started)."""
        code = None
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.terminate()
                try:
                    self.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
            code = self.popen.wait()
            self.popen = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        return code


def remote_class():
    import ray

    # Restarting is the supervisor's decision (restart budget), never Ray's.
    return ray.remote(max_restarts=0, max_task_retries=0)(ProcessHost)
