"""Internal TCP endpoints with CurveZMQ: only peers holding the deployment's client key get through."""

from __future__ import annotations

import shutil
import stat

import pytest
import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.curve import CurveKeyError
from pagedserve.protocol.zmq_io import Endpoints, Receiver, Sender, TcpLayout, make_run_dir, write_tcp_layout
from support.server import free_port_range


@pytest.fixture
def curve_run_dir(tmp_path):
    run_dir = make_run_dir(str(tmp_path))
    layout = TcpLayout("127.0.0.1", free_port_range(6), tp_size=2, num_replicas=1, curve=True)
    write_tcp_layout(run_dir, layout)
    return run_dir


def message(i: int) -> m.AbortRequest:
    return m.AbortRequest([f"req-{i}"])


def test_curve_keys_and_layout_are_private_files_and_endpoints_are_tcp(curve_run_dir):
    files = [curve_run_dir / "endpoints.json", *(curve_run_dir / "curve").iterdir()]
    assert {p.name for p in files} >= {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((curve_run_dir / "curve").stat().st_mode) == 0o700
    ep = Endpoints(curve_run_dir)
    base = ep.tcp.port_base
    assert [ep.supervisor(), ep.frontend_outputs(), ep.scheduler_inputs(0), ep.workers(0)] == \
        [f"tcp://127.0.0.1:{base + k}" for k in range(4)]
    with pytest.raises(ValueError, match="replica 1"):
        ep.scheduler_inputs(1)


def test_a_non_loopback_tcp_layout_without_curve_is_refused():
    with pytest.raises(ValueError, match="CurveZMQ"):
        TcpLayout("10.1.2.3", 20000, tp_size=1, num_replicas=1, curve=False)
    assert TcpLayout("127.0.0.1", 20000, tp_size=1, num_replicas=1, curve=False).num_ports() == 4


def test_only_a_client_with_the_deployment_keys_reaches_a_curve_socket(curve_run_dir, tmp_path):
    ctx = zmq.Context()
    ep = Endpoints(curve_run_dir).scheduler_inputs(0)
    rx = Receiver(ctx, ep, m.FrontendToScheduler)
    intruders, tx = [], None
    try:
        # No CURVE at all: the handshake cannot even start.
        plain = ctx.socket(zmq.PUSH)
        intruders.append(plain)
        # CURVE with the right server key but a keypair of its own: the ZAP handler says no.
        forged = ctx.socket(zmq.PUSH)
        public, secret = zmq.curve_keypair()
        forged.curve_serverkey = zmq.auth.load_certificate(str(curve_run_dir / "curve" / "server.key"))[0]
        forged.curve_publickey, forged.curve_secretkey = public, secret
        intruders.append(forged)
        for sock in intruders:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(str(ep))
            sock.send(encode(message(666)))
        # A peer that has only what a worker node gets (server.key + client.key_secret).
        worker_dir = tmp_path / "worker-node"
        (worker_dir / "curve").mkdir(parents=True)
        shutil.copy(curve_run_dir / "endpoints.json", worker_dir)
        for name in ("server.key", "client.key_secret"):
            shutil.copy(curve_run_dir / "curve" / name, worker_dir / "curve")
        tx = Sender(ctx, Endpoints(worker_dir).scheduler_inputs(0))
        for i in range(3):
            tx.send(message(i))
        got = [rx.recv(timeout_ms=10_000) for _ in range(3)]
        assert [g.request_ids for g in got] == [["req-0"], ["req-1"], ["req-2"]]
        assert rx.recv(timeout_ms=500) is None  # the intruders' frames never arrive
        assert rx.num_rejected == 0  # ...not even as rejected frames: they never got through
    finally:
        for sock in intruders:
            sock.close(linger=0)
        if tx is not None:
            tx.close()
        rx.close()
        ctx.term()


def test_a_worker_node_missing_the_client_secret_key_is_told_which_file_to_copy(curve_run_dir, tmp_path):
    worker_dir = tmp_path / "incomplete"
    (worker_dir / "curve").mkdir(parents=True)
    shutil.copy(curve_run_dir / "endpoints.json", worker_dir)
    shutil.copy(curve_run_dir / "curve" / "server.key", worker_dir / "curve")
    ctx = zmq.Context()
    try:
        with pytest.raises(CurveKeyError, match="client.key_secret"):
            Sender(ctx, Endpoints(worker_dir).workers(0))
    finally:
        ctx.destroy(linger=0)
