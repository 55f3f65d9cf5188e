"""The fork server (deploy/fork_server.py): a child forked from it behaves as the same command
exec'd would, as far as a deployment can tell (argv, environment, working directory, streams,
exit codes, process title, OpenMP threads), and none outlives its parent. It runs only the
modules it was started to run, for its own user, and listens only in a private directory.

The tests' modules live in a directory on the server's PYTHONPATH, named with --allow-module:
a child imports nothing from its working directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from pagedserve.deploy.entry_points import python_module

from support.fault_helpers import process_gone as gone
from support.server import wait_until
from pagedserve.deploy.fork_client import (START_METHOD_ENV, ForkServerConnection, ForkServerError,
                                           acquire_fork_server, release_fork_server)

pytestmark = pytest.mark.slow  # every test starts a fork server


TEST_MODULES = ("report_args", "raises", "sleeps", "omp_threads", "fine", "sleeps_long", "sleeps_shared", "exits_3",
                "sleeper")


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    return tmp_path_factory.mktemp("modules")


def fork_server(modules, **kwargs) -> ForkServerConnection:
    """A fork server that may run the test modules, found on its PYTHONPATH."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(modules)
    try:
        return ForkServerConnection(allow_modules=TEST_MODULES, **kwargs)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def server(modules):
    conn = fork_server(modules)
    yield conn
    conn.close()


@pytest.fixture
def module_dir(modules, tmp_path, monkeypatch):
    """Modules written to the server's path run as ``python -P -m NAME`` from ``tmp_path``, the
    children's working directory."""
    monkeypatch.chdir(tmp_path)

    def write(name: str, body: str) -> list[str]:
        assert name in TEST_MODULES
        (modules / f"{name}.py").write_text(textwrap.dedent(body))
        return python_module(name)

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
    # rstrip: the title is padded with NULs to the server's own argv (long here, with --allow-module)
    assert wait_until(lambda: " ".join(psutil.Process(child.pid).cmdline()).rstrip() == " ".join(child.args), 10), \
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


def test_closing_the_connection_kills_the_children_still_running(modules, module_dir):
    conn = fork_server(modules)
    child = conn.spawn(module_dir("sleeps_long", "import time\ntime.sleep(600)\n"))
    server_pid = conn.proc.pid
    conn.close()
    assert wait_until(lambda: gone(child.pid) and gone(server_pid), 5, interval_s=0.02)


def test_a_sigkilled_parent_leaves_neither_the_server_nor_its_children(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from pagedserve.deploy.fork_client import ForkServerConnection
        conn = ForkServerConnection(allow_modules=("sleeper",))
        child = conn.spawn([sys.executable, "-m", "sleeper"])
        print(conn.proc.pid, child.pid, flush=True)
        time.sleep(600)
    """))
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(tmp_path)})
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
        modules, module_dir, tmp_path):
    import tempfile

    address = os.path.join(tempfile.mkdtemp(prefix="pfs-"), "fork.sock")  # mkdtemp: a private dir
    owner = fork_server(modules, listen=address)
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


def test_a_module_outside_its_entry_points_is_refused_logged_and_the_server_goes_on(modules, module_dir, capfd):
    server = fork_server(modules)  # its stderr is this test's
    try:
        with pytest.raises(ForkServerError, match="not one of this deployment's entry points"):
            server.spawn(python_module("http.server", "8000"))
        assert "pagedserve fork server: refused a request" in capfd.readouterr().err
        assert server.spawn(module_dir("fine", "pass\n")).wait(60) == 0
    finally:
        server.close()


def test_a_peer_of_another_uid_is_refused_even_where_the_filesystem_lets_it_in(modules, tmp_path):
    import pwd
    import tempfile

    if os.getuid() != 0:
        pytest.skip("only root can start a peer of another uid here")
    nobody = pwd.getpwnam("nobody")
    directory = tempfile.mkdtemp(prefix="pfs-")
    owner = fork_server(modules, listen=os.path.join(directory, "fork.sock"))
    try:
        owner._check_ready()
        os.chmod(directory, 0o711)  # after the server checked it: only the uid check stands now
        os.chmod(owner.address, 0o777)
        probe = textwrap.dedent(f"""
            import os, socket
            os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect({owner.address!r})
            s.settimeout(30)
            print(repr(s.recv(1 << 16)))
        """)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "b''"  # closed before the hello, and nothing could be asked for
        assert owner.spawn(python_module("fine")).wait(60) == 0
    finally:
        owner.close()
        os.rmdir(directory)


def test_a_listen_path_in_a_directory_others_may_write_is_refused_and_the_parent_is_still_served(
        modules, module_dir, tmp_path, capfd):
    shared = tmp_path / "world-writable"
    shared.mkdir()
    os.chmod(shared, 0o777)
    owner = fork_server(modules, listen=str(shared / "fork.sock"))
    try:
        assert owner.spawn(module_dir("fine", "pass\n")).wait(60) == 0
        assert not (shared / "fork.sock").exists()
        assert "refused to listen at" in capfd.readouterr().err
        assert not ForkServerConnection(address=str(shared / "fork.sock")).alive()
    finally:
        owner.close()
