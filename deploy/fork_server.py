"""The fork server: loads torch, transformers and xgrammar once, then forks a deployment's
schedulers, workers and frontend from that state:
``python -m pagedserve.deploy.fork_server FD [--listen PATH]``.

Each runtime process loads torch and transformers (the worker for the model, the frontend for
the tokenizer, the scheduler for xgrammar's), 3-4 CPU-s apiece: most of a start's CPU on 2
cores (bench/log/2026-11-28.md "Starting a deployment from a fork server"). A child forked from here
starts with them loaded, shared copy-on-write, and runs the ``python -m`` entry point its
command names (runpy), with the parent's argv, environment, working directory and standard
streams, under the command line as its process title.

It runs code on request, so it runs only pagedserve's own entry points (``ENTRY_MODULES``, plus
any its starter named with ``--allow-module``), only for a peer of its own uid (``SO_PEERCRED``),
and listens only in a directory private to its user. A refused request is logged on stderr and
the server goes on. Its children import what is installed: the server runs with ``-P`` and a
child keeps its ``sys.path``, never the working directory (``entry_points.py``).

The wire (SOCK_SEQPACKET, msgpack, never pickle): a client sends ``{"argv", "env", "cwd"}``
with four descriptors (stdin, stdout, stderr, the write end of a status pipe) and gets
``{"pid"}`` or ``{"error"}``. When a child ends, its exit code as ``subprocess`` gives it
(negative: the signal) goes to its status pipe as 4 bytes. A client's first message is
``{"ready", "pid", "threads", "openmp"}`` once loaded (the OpenMP settings torch loaded with):
forking is safe only while this process runs one thread, and the client checks.

The parent's end is FD, one end of a socketpair; ``--listen`` also accepts clients on a unix
socket in a private directory (other processes' deployments). When a client's end closes (it
stopped, or died however it died) the children it asked for are SIGKILLed; when the parent's
closes, all are and the server exits (once loaded, if it was still loading). Each child dies
with the server (PDEATHSIG), so none outlives the process that asked for it. No logging is
configured here, so each child's ``basicConfig`` still sets its own format.
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Optional

import msgspec

from pagedserve.clean_path import drop_working_directory
from pagedserve.deploy.entry_points import ENTRY_MODULES, arguments_of, module_of
from pagedserve.deploy.parent_death import die_with_parent
from pagedserve.runtime.process_exit import exit_now

MAX_REQUEST_BYTES = 1 << 20
STATUS = struct.Struct("<i")
PRELOAD = ("zmq", "torch", "transformers", "xgrammar", "setproctitle", "pagedserve.protocol")


def preload() -> None:
    """What every child would otherwise load for itself."""
    from pagedserve.runtime.torch_env import apply_torch_env_defaults

    apply_torch_env_defaults()  # libgomp and torch read them when torch loads, here
    # numpy's OpenBLAS starts a thread pool as it loads, and a fork is safe only from one
    # thread: load it with one. No process of a deployment multiplies with numpy (torch does).
    blas_threads = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        if blas_threads is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = blas_threads
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # optional ones (xgrammar on an exotic platform): the child reports it
            pass
    if "setproctitle" in sys.modules:  # claims argv's memory now: once a child replaces environ it cannot
        title = sys.modules["setproctitle"]
        title.setproctitle(title.getproctitle())
    transformers = sys.modules.get("transformers")
    if transformers is not None:  # its lazy module loads these on first touch
        transformers.AutoTokenizer, transformers.AutoConfig  # noqa: B018
    gc.collect()
    gc.freeze()  # out of every child's collections: their pages stay shared


def refuse(why: str) -> None:
    """No logging is configured here (each child's ``basicConfig`` sets its own): one stderr line."""
    print(f"pagedserve fork server: refused {why}", file=sys.stderr, flush=True)


def private_directory_problem(path: str) -> Optional[str]:
    """Why the directory of ``path`` is not private to this user (None when it is): anyone who
    can write there could put their own socket in its place."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(directory)
    except OSError as exc:
        return f"cannot stat {directory}: {exc.strerror}"
    if st.st_uid != os.getuid():
        return f"{directory} belongs to uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"{directory} has mode {oct(st.st_mode & 0o777)}; others may enter it (0700 is private)"
    return None


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class ForkServer:
    """Serves fork requests on ``control`` (the parent's end) and on every connection accepted
    by ``listener`` (``--listen``: other processes' deployments)."""

    def __init__(self, control: socket.socket, listener: Optional[socket.socket] = None,
                 allowed_modules: frozenset[str] = ENTRY_MODULES):
        self.control, self.listener = control, listener
        self.allowed_modules = allowed_modules
        self.pid = os.getpid()
        self.hello: dict = {}
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pid -> (its status pipe, who asked)
        self.encoder = msgspec.msgpack.Encoder()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.control, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ)

    def send(self, conn: socket.socket, **fields) -> None:
        conn.send(self.encoder.encode(fields))

    def run(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.wake_r:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif key.fileobj is self.listener:
                    self.accept()
                elif not self.serve_one(key.fileobj):
                    if key.fileobj is self.control:
                        self.kill_children(None)
                        return
                    self.drop(key.fileobj)
            self.reap()

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        uid = peer_uid(conn)
        if uid != os.getuid():
            refuse(f"a connection from uid {uid}: it serves uid {os.getuid()} only")
            conn.close()
            return
        self.selector.register(conn, selectors.EVENT_READ)
        try:
            self.send(conn, **self.hello)
        except OSError:
            self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        """A client that went away (stopped, or died): its children go with it."""
        self.selector.unregister(conn)
        conn.close()
        self.kill_children(conn)

    def serve_one(self, conn: socket.socket) -> bool:
        """One fork request; False once that end has closed."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST_BYTES, 4)
        except (ConnectionResetError, OSError):
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            request = msgspec.msgpack.decode(data)
            argv, env, cwd = list(request["argv"]), dict(request["env"]), str(request["cwd"])
            module = module_of(argv)
            if len(fds) != 4 or module is None:
                raise ValueError(f"a request needs argv [python, -m, module, ...] and 4 descriptors, "
                                 f"got {argv[:3]} and {len(fds)}")
            if module not in self.allowed_modules:
                raise PermissionError(f"module {module!r} is not one of this deployment's entry points "
                                      f"({', '.join(sorted(self.allowed_modules))})")
        except Exception as exc:  # a malformed or refused request fails that spawn, never the server
            for fd in fds:
                os.close(fd)
            refuse(f"a request: {type(exc).__name__}: {exc}")
            self.send(conn, error=f"{type(exc).__name__}: {exc}")
            return True
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.become(argv, module, env, cwd, fds)  # never returns
        for fd in fds[:3]:
            os.close(fd)
        self.children[pid] = (fds[3], conn)
        try:
            self.send(conn, pid=pid)
        except OSError:  # gone already: the child goes when its end is seen closed
            pass
        return True

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fd, _conn = self.children.pop(pid, (None, None))
            if fd is not None:
                try:
                    os.write(fd, STATUS.pack(os.waitstatus_to_exitcode(status)))
                except OSError:  # the parent closed its end: nobody is waiting for it
                    pass
                os.close(fd)

    def kill_children(self, of: Optional[socket.socket]) -> None:
        """Those ``of`` one client asked for, or every one."""
        for pid, (_fd, conn) in self.children.items():
            if of is None or conn is of:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def become(self, argv: list[str], module: str, env: dict, cwd: str, fds: list[int]) -> None:
        """In the child: drop the server's state, take the request's, run its module."""
        code = 1
        try:
            os.setpgid(0, 0)  # a terminal's Ctrl-C reaches only the supervisor, as for exec'd children
            die_with_parent(self.pid)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for key in list(self.selector.get_map().values()):
                if key.fileobj is not self.wake_r:
                    key.fileobj.close()  # the parent's end, the listener and every client's
            self.selector.close()
            os.close(self.wake_r)
            for fd, _conn in self.children.values():
                os.close(fd)
            os.close(fds[3])
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            try:
                import setproctitle

                setproctitle.setproctitle(" ".join(argv))  # ps and psutil show the command, as if exec'd
            except ImportError:
                pass
            # sys.path stays the server's: ``python -P -m`` puts no working directory on it
            sys.argv = [module, *arguments_of(argv)]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exit_code(exc.code)
        except BaseException:
            traceback.print_exc()
        finally:
            exit_now(code)  # never back into the server's loop


def exit_code(value) -> int:
    """What the interpreter would exit with for ``SystemExit(value)``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def main() -> None:
    drop_working_directory()  # before preload() imports transformers
    parser = argparse.ArgumentParser(prog="pagedserve.deploy.fork_server")
    parser.add_argument("fd", type=int, help="the parent's end of their socketpair")
    parser.add_argument("--listen", help="also serve other processes on this unix socket (in a private dir)")
    parser.add_argument("--allow-module", action="append", default=[],
                        help="a module to run besides pagedserve's entry points (the fork server's own tests)")
    ns = parser.parse_args()
    listener = None
    if ns.listen:
        problem = private_directory_problem(ns.listen)
        if problem is not None:  # it serves its parent still; other deployments start theirs by exec
            refuse(f"to listen at {ns.listen}: {problem}")
        else:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(ns.listen)
            listener.listen(64)
    server = ForkServer(socket.socket(fileno=ns.fd), listener, ENTRY_MODULES | frozenset(ns.allow_module))
    try:
        preload()
    except BaseException as exc:  # the parent falls back to starting its children itself
        try:
            server.send(server.control, error=f"preloading failed: {type(exc).__name__}: {exc}")
        except OSError:
            pass
        return
    openmp = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_"))}
    server.hello = dict(ready=True, pid=os.getpid(), threads=thread_count(), openmp=openmp)
    try:
        server.send(server.control, **server.hello)
    except OSError:  # the parent closed its end while this loaded: nothing to serve
        return
    server.run()


if __name__ == "__main__":
    main()
