"""CurveZMQ for internal TCP endpoints: key files in the run dir, and client authentication.

A deployment has two keypairs, generated into ``RUN_DIR/curve/`` (0700, files 0600, the
ZeroMQ certificate format that ``zmq.auth.load_certificate`` reads):

- ``server``: every socket that binds is a CURVE server with this secret key;
- ``client``: every socket that connects is a CURVE client with this keypair and the
  server's public key.

Encryption alone would let anyone holding the server's public key connect, so each
process that binds also runs a ZAP handler that accepts only the deployment's client
public key: a peer without ``client.key_secret`` never completes the handshake and its
frames never arrive. A node that only connects (a worker node) needs just
``server.key`` and ``client.key_secret``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

CURVE_DIR = "curve"
SERVER = "server"
CLIENT = "client"


class CurveKeyError(RuntimeError):
    """A CURVE key file this process needs is missing or unreadable."""


def generate_curve_keys(run_dir: str | Path) -> Path:
    """Write fresh server and client keypairs into ``run_dir/curve`` (0700; files 0600)."""
    curve_dir = Path(run_dir) / CURVE_DIR
    curve_dir.mkdir(mode=0o700)
    os.chmod(curve_dir, 0o700)  # mkdir's mode is filtered by the umask
    for name in (SERVER, CLIENT):
        public_file, secret_file = zmq.auth.create_certificates(str(curve_dir), name)
        for path in (public_file, secret_file):
            os.chmod(path, 0o600)
    return curve_dir


def load_key(curve_dir: Path, name: str, secret: bool) -> tuple[bytes, Optional[bytes]]:
    """(public, secret) of one keypair; secret is None when only the public file is read."""
    path = curve_dir / (f"{name}.key_secret" if secret else f"{name}.key")
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the CURVE key {path} ({exc}); on a worker node copy "
                            f"server.key and client.key_secret from the head node's run dir") from exc
    return public, secret_key


class _OnlyClientKey:
    """ZAP credentials check: the deployment's client key and nothing else."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self.client_public


# One ZAP handler per libzmq context (it binds inproc://zeromq.zap.01 there), shared by
# every CURVE server socket of that context and stopped when the last one closes.
_authenticators: dict[int, list] = {}


def _acquire_authenticator(ctx: zmq.Context, client_public: bytes) -> Callable[[], None]:
    key = ctx.underlying
    entry = _authenticators.get(key)
    if entry is None:
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_OnlyClientKey(client_public))
        entry = _authenticators[key] = [auth, 0]
    entry[1] += 1
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        entry[1] -= 1
        if entry[1] == 0:
            entry[0].stop()
            _authenticators.pop(key, None)

    return release


def secure_socket(ctx: zmq.Context, sock: zmq.Socket, curve_dir: Path, bind: bool) -> Callable[[], None]:
    """Make ``sock`` a CURVE server (bind) or client (connect); returns what to call on close.

    Must run before the socket binds or connects.
    """
    if bind:
        client_public, _ = load_key(curve_dir, CLIENT, secret=False)
        server_public, server_secret = load_key(curve_dir, SERVER, secret=True)
        release = _acquire_authenticator(ctx, client_public)
        sock.curve_publickey = server_public
        sock.curve_secretkey = server_secret
        sock.curve_server = True
        return release
    server_public, _ = load_key(curve_dir, SERVER, secret=False)
    client_public, client_secret = load_key(curve_dir, CLIENT, secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_secret
    return lambda: None
