"""The fork server (deploy/fork_server.py): a child forked from it behaves as the same command
exec'd would, as far as a deployment can tell (argv, environment, working directory, streams,
exit codes, process title, OpenMP threads), and none outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from support.fault_helpers import process_gone as gone
from support.server import wait_until
from pagedserve.deploy.fork_client import (START_METHOD_ENV, ForkServerConnection, ForkServerError,
                                           acquire_fork_server, release_fork_server)

pytestmark = pytest.mark.slow  # every test starts a fork server


@pytest.fixture(scope="module")
def server():
    conn = ForkServerConnection()
    yield conn
    conn.close()


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """Modules written here run as ``python -m NAME`` from here, the children's working directory."""
    monkeypatch.chdir(tmp_path)

    def write(name: str, body: str) -> list[str]:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        return [sys.executable, "-m", name]

    return write


def test_argv_environment_cwd_and_exit_code_are_the_commands(server, module_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_TEST_VALUE", "from the parent at spawn time")
    cmd = module_dir("report_args", """
        import json, os, sys
        with open("report.json", "w") as f:
            json.dump({"argv": sys.argv[1:], "env": os.environ.get("FORK_TEST_VALUE"), "cwd": os.getcwd(),
                       "name": __name__}, f)
        sys.exit(7)
    """)
    child = server.spawn([*cmd, "--flag", "two words"])
    assert child.wait(60) == 7
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert report == {"argv": ["--flag", "two words"], "env": "from the parent at spawn time",
                      "cwd": str(tmp_path), "name": "__main__"}


def test_an_uncaught_exception_is_code_1_with_its_traceback_on_the_parents_stderr(server, module_dir, capfd):
    child = server.spawn(module_dir("raises", "raise RuntimeError('the child failed here')\n"))
    assert child.wait(60) == 1
    assert "RuntimeError: the child failed here" in capfd.readouterr().err


def test_a_signal_is_a_negative_code_and_the_title_is_the_command_line(server, module_dir):
    cmd = module_dir("sleeps", "import time\ntime.sleep(600)\n")
    child = server.spawn([*cmd, "--run-dir", "/somewhere/run-1"])
    assert child.poll() is None
    assert wait_until(lambda: " ".join(psutil.Process(child.pid).cmdline()) == " ".join(child.args), 10), \
        psutil.Process(child.pid).cmdline()
    assert psutil.Process(child.pid).ppid() == server.proc.pid
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.05)
    child.terminate()
    assert child.wait(10) == -signal.SIGTERM
    assert child.poll() == -signal.SIGTERM
    child.kill()  # after its end: nothing to signal, no error


def test_openmp_runs_the_threads_the_child_asks_for_after_the_fork(server, module_dir, tmp_path):
    """torch is loaded in the server and its OpenMP pool must not be: a forked pool hangs or runs
    one thread. The child asks for 2 threads and checks that a parallel op ran on 2."""
    cmd = module_dir("omp_threads", """
        import os, sys, torch
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        for _ in range(20):
            x = torch.tanh(x @ x)
        seen = len(os.listdir("/proc/self/task"))
        open("omp.txt", "w").write(f"{torch.get_num_threads()} {seen}")
    """)
    assert server.spawn(cmd).wait(120) == 0
    threads, seen = (tmp_path / "omp.txt").read_text().split()
    assert int(threads) == 2 and int(seen) >= 2
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        assert server.openmp["GOMP_SPINCOUNT"] == "10000"  # the worker's, applied before torch loaded there


def test_a_malformed_request_is_refused_and_the_server_goes_on(server, module_dir):
    with server.lock:
        server._check_ready()
        server.sock.send(b"\xc1 not msgpack")
        reply = server._recv(10)
    assert "error" in reply
    with pytest.raises(ForkServerError, match="argv"):
        server.spawn(["/bin/true"])
    assert server.spawn(module_dir("fine", "pass\n")).wait(60) == 0


def test_closing_the_connection_kills_the_children_still_running(module_dir):
    conn = ForkServerConnection()
    child = conn.spawn(module_dir("sleeps_long", "import time\ntime.sleep(600)\n"))
    server_pid = conn.proc.pid
    conn.close()
    assert wait_until(lambda: gone(child.pid) and gone(server_pid), 5, interval_s=0.02)


def test_a_sigkilled_parent_leaves_neither_the_server_nor_its_children(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from pagedserve.deploy.fork_client import ForkServerConnection
        conn = ForkServerConnection()
        child = conn.spawn([sys.executable, "-m", "sleeper"])
        print(conn.proc.pid, child.pid, flush=True)
        time.sleep(600)
    """))
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        server_pid, child_pid = map(int, parent.stdout.readline().split())
        parent.kill()
        parent.wait(10)
        assert wait_until(lambda: gone(server_pid) and gone(child_pid), 5, interval_s=0.02)
    finally:
        parent.kill()
        parent.wait()


def test_one_server_is_shared_by_a_processs_cpu_deployments_and_stops_with_the_last(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert acquire_fork_server("cuda") is None  # not checked on a GPU: exec'd there
    first = acquire_fork_server("cpu")
    others = first.users - 1  # a session-wide offline LLM may hold it too
    second = acquire_fork_server("cpu")
    assert second is first and first.users == others + 2
    release_fork_server(first)
    release_fork_server(second)
    if others == 0:
        assert first.proc.wait(10) == 0
    else:
        assert first.proc.poll() is None and first.users == others
    monkeypatch.setenv(START_METHOD_ENV, "exec")
    assert acquire_fork_server("cpu") is None


def test_a_listening_server_forks_for_every_client_and_a_client_that_goes_takes_only_its_children(
        module_dir, tmp_path):
    import tempfile

    address = os.path.join(tempfile.mkdtemp(prefix="pfs-"), "fork.sock")  # mkdtemp: a private dir
    owner = ForkServerConnection(listen=address)
    try:
        owner._check_ready()
        first, second = ForkServerConnection(address=address), ForkServerConnection(address=address)
        cmd = module_dir("sleeps_shared", "import time\ntime.sleep(600)\n")
        a, b = first.spawn(cmd), second.spawn(cmd)
        assert first.server_pid == second.server_pid == owner.proc.pid
        assert psutil.Process(a.pid).ppid() == psutil.Process(b.pid).ppid() == owner.proc.pid
        first.close()  # as a supervisor's end closes when it stops or dies
        assert wait_until(lambda: gone(a.pid), 5, interval_s=0.02)
        assert b.poll() is None
        assert second.spawn(module_dir("exits_3", "raise SystemExit(3)\n")).wait(60) == 3
        b.kill()
        assert b.wait(10) == -signal.SIGKILL
        second.close()
    finally:
        owner.close()
    assert not ForkServerConnection(address=address).alive()  # nobody listens: spawns are exec'd
    os.rmdir(os.path.dirname(address))  # empty: the owner removed its socket
