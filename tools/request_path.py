"""How many of pagedserve's named functions and classes one ``/v1/completions`` request passes.

``python -m pagedserve.tools.request_path [--model DIR] [--stream] [--path]`` starts a real
deployment (``pagedserve serve``, the demo model by default) with ``PAGEDSERVE_CALL_TRACE`` set,
sends two warm-up requests, then records exactly one request in every process
(``pagedserve/call_trace.py``: SIGUSR2 opens and closes the window) and prints, per process and
in all, the named functions (lambdas and comprehensions left out), the classes they belong to,
and the files. ``--path`` prints each process's functions in the order first called.

The window holds what the processes did while the request was in flight, so a scheduler step
or a worker forward counts everything it ran, as it does for every request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

_BODY = {"prompt": "Hello, world! How are you today?", "max_tokens": 8, "temperature": 0}


def _post(port: int, body: dict, timeout: float = 60.0) -> bytes:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _wait_healthy(port: int, server: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if server.poll() is not None:
            raise SystemExit(f"request_path: the server exited with code {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)  # polling a server that is starting: no event to wait on across processes
    raise SystemExit(f"request_path: the server was not healthy within {deadline_s:g}s")


def _signal_all(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)


def _wait_files(out: Path, pids: list[int], deadline_s: float = 30.0) -> list[dict]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        files = [out / f"{pid}.json" for pid in pids]
        if all(f.is_file() for f in files):
            return [json.loads(f.read_text()) for f in files]
        time.sleep(0.05)
    raise SystemExit("request_path: not every process wrote its calls")


def _summary(calls: list[list[str]]) -> tuple[int, int, int]:
    functions = {(path, name) for path, name in calls}
    classes = {(path, name.rsplit(".", 1)[0]) for path, name in calls if "." in name and "<locals>" not in name}
    files = {path for path, _ in calls}
    return len(functions), len(classes), len(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.tools.request_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--stream", action="store_true", help="record a streamed request")
    parser.add_argument("--path", action="store_true", help="print each process's functions in call order")
    ns = parser.parse_args(argv)

    out = Path(tempfile.mkdtemp(prefix="pagedserve-request-path-"))
    env = dict(os.environ, PAGEDSERVE_CALL_TRACE=str(out))
    command = [sys.executable, "-P", "-m", "pagedserve.deploy.cli", "serve", "--port", str(ns.port)]
    if ns.model:
        command += ["--model", ns.model]
    server = subprocess.Popen(command, env=env, cwd=tempfile.gettempdir(), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(ns.port, server, 300.0)
        body = dict(_BODY, model=json.loads(urllib.request.urlopen(
            f"http://127.0.0.1:{ns.port}/v1/models", timeout=10).read())["data"][0]["id"], stream=ns.stream)
        for _ in range(2):
            _post(ns.port, body)
        pids = [int(f.stem) for f in out.glob("*.ready")]
        _signal_all(pids)
        _post(ns.port, body)
        _signal_all(pids)
        records = _wait_files(out, pids)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    everything: list[list[str]] = []
    print(f"one /v1/completions request ({'streamed' if ns.stream else 'not streamed'}, max_tokens "
          f"{_BODY['max_tokens']}), pagedserve code only:")
    print(f"{'process':<12} {'functions':>9} {'classes':>8} {'files':>6}")
    for record in sorted(records, key=lambda r: r["process"]):
        functions, classes, files = _summary(record["calls"])
        print(f"{record['process']:<12} {functions:>9} {classes:>8} {files:>6}")
        everything += record["calls"]
    functions, classes, files = _summary(everything)
    print(f"{'all':<12} {functions:>9} {classes:>8} {files:>6}   named functions + classes: {functions + classes}")
    if ns.path:
        for record in sorted(records, key=lambda r: r["process"]):
            print(f"\n# {record['process']} (pid {record['pid']})")
            for path, name in record["calls"]:
                print(f"  {path}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
