"""The scheduler <-> worker channel (protocol/worker_link.py), in one process: only the
replica's own workers receive its steps, and only their answers are accepted."""

from __future__ import annotations

import stat
import time

import pytest
import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.worker_link import (
    PEER_KEY_FILE, PeerUnreachable, SchedulerLink, WorkerRouter, mint_routing_id, verified_rank)
from pagedserve.protocol.zmq_io import Endpoints, make_run_dir

NO_DECODES = m.DecodeBatch([], [], [], [])


def hello(rank: int) -> m.WorkerHello:
    return m.WorkerHello(rank, 1234, "cpu", "model", 2, 4096, 10)


def step(n: int) -> bytes:
    return encode(m.SchedulerOutput(n, [], [], NO_DECODES, [], [], [], [], [], 0))


@pytest.fixture
def link(tmp_path):
    ctx = zmq.Context()
    ep = Endpoints(make_run_dir(str(tmp_path)))
    router = WorkerRouter(ctx, ep, replica=0, tp_size=2)
    workers = [SchedulerLink(ctx, ep, replica=0, rank=r) for r in range(2)]
    strays: list[zmq.Socket] = []
    yield ctx, ep, router, workers, strays
    for s in strays:
        s.close(linger=0)
    for w in workers:
        w.close()
    router.close()
    ctx.term()


def _say_hello(router, workers) -> None:
    for rank, w in enumerate(workers):
        w.send(hello(rank))
    got = [router.recv(timeout_ms=5000) for _ in workers]
    assert sorted(g.rank for g in got) == list(range(len(workers)))


def test_routing_ids_verify_only_with_the_key_and_rank_they_were_minted_for():
    key = b"k" * 32
    rid = mint_routing_id(key, 3)
    assert verified_rank(key, rid) == 3
    assert verified_rank(b"x" * 32, rid) is None
    assert verified_rank(key, rid[:-1] + bytes([rid[-1] ^ 1])) is None
    assert verified_rank(key, b"w" + (1).to_bytes(2, "big") + rid[3:]) is None  # rank swapped
    assert verified_rank(key, b"\x00\x01\x02") is None
    assert mint_routing_id(key, 0) != mint_routing_id(key, 0)  # a restarted worker is a new peer


def test_the_peer_key_is_a_private_file_in_the_run_dir(link):
    _, ep, *_ = link
    path = ep.run_dir / PEER_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_bytes()) == 32


def test_stray_pull_push_and_dealer_peers_neither_take_steps_nor_inject_results(link):
    ctx, ep, router, workers, strays = link
    pull, push, dealer = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    strays += [pull, push, dealer]
    for s in strays:
        # Bounded sends: a PUSH that has no pipe to queue to waits for one forever, and whether
        # libzmq keeps one for a peer the router refused at handshake is its own business (one
        # full-suite run hung in this test). A stray that cannot send injects nothing either.
        s.setsockopt(zmq.SNDTIMEO, 2000)
        s.connect(ep.workers(0))
    _say_hello(router, workers)
    fake = encode(m.StepResult(1, 0, ["r"], [42]))
    for sock, frame in ((push, fake), (dealer, encode(hello(0))), (dealer, fake)):  # a stray hello is no worker's
        try:
            sock.send(frame)
        except zmq.Again:
            assert sock is push, "the stray dealer (a socket type the router accepts) could not send"
    for n in range(1, 21):
        router.broadcast(step(n))
        assert [w.recv(timeout_ms=5000).step for w in workers] == [n, n]
        workers[0].send(m.StepResult(n, 0, ["r"], [n]))
        workers[1].send(m.StepResult(n, 1, [], []))
        got = sorted((r.rank, r.step, r.sampled_token_ids) for r in (router.recv(5000), router.recv(5000)))
        assert got == [(0, n, [n]), (1, n, [])]
    deadline = time.monotonic() + 10  # the stray dealer's two frames arrive when they arrive
    while router.check.num_rejected < 2 and time.monotonic() < deadline:
        assert router.recv(timeout_ms=100) is None  # nothing stray ever comes out as a result
    assert router.check.num_rejected >= 2
    assert not pull.poll(200) and not dealer.poll(0)


def test_a_worker_cannot_answer_for_another_rank_and_a_replaced_worker_is_not_heard(link):
    ctx, ep, router, workers, _ = link
    _say_hello(router, workers)
    workers[1].send(m.StepResult(1, 0, ["r"], [7]))  # rank 1's worker claims rank 0
    assert router.recv(timeout_ms=300) is None
    router.forget_peers()
    workers[0].send(m.StepResult(1, 0, ["r"], [7]))  # the old worker after a failure
    assert router.recv(timeout_ms=300) is None
    with pytest.raises(PeerUnreachable, match="rank 0"):
        router.broadcast(step(2))
    fresh = SchedulerLink(ctx, ep, replica=0, rank=0)
    try:
        fresh.send(hello(0))
        assert isinstance(router.recv(timeout_ms=5000), m.WorkerHello)
        assert router.peers[0] != workers[0].sock.getsockopt(zmq.ROUTING_ID)
    finally:
        fresh.close()


def test_a_worker_that_disconnected_makes_the_broadcast_fail_instead_of_vanishing(link):
    _, _, router, workers, _ = link
    _say_hello(router, workers)
    workers[1].close()

    def unreachable() -> bool:
        try:
            router.broadcast(step(1))
            return False
        except PeerUnreachable:
            return True

    deadline = time.monotonic() + 5
    while not unreachable():
        assert time.monotonic() < deadline, "the broadcast never noticed the disconnected worker"
        time.sleep(0.01)  # libzmq notices the closed ipc connection asynchronously
