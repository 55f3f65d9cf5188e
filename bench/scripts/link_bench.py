"""What the authenticated worker channel costs per step, against the PUSH/PULL pair it replaced.

A "scheduler" in this process sends a SchedulerOutput of N decodes to a "worker" in a
child process over ipc; the worker decodes it and answers with a StepResult of N tokens,
which the scheduler decodes. Both sides run the real socket classes: ``push-pull`` is
zmq_io.Sender/Receiver (the old layout: one PUSH per worker, one PULL for results),
``router-dealer`` is worker_link.WorkerRouter/SchedulerLink (routing ids with a MAC).
Printed: median round trip per step in microseconds.

    python bench/scripts/link_bench.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import zmq

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.worker_link import SchedulerLink, WorkerRouter
from pagedserve.protocol.zmq_io import Endpoint, Endpoints, Receiver, Sender, ipc_endpoint, make_run_dir


def step_frame(step: int, n: int) -> bytes:
    ids = [f"r{i}" for i in range(n)]
    decodes = m.DecodeBatch(ids, [100 + i for i in range(n)], [7] * n, [])
    return encode(m.SchedulerOutput(step, [], [], decodes, [], [], [], [], [], n))


def _pair_endpoints(run_dir: str) -> tuple[Endpoint, Endpoint]:
    return Endpoint(ipc_endpoint(run_dir, "bench-steps")), Endpoint(ipc_endpoint(run_dir, "bench-results"))


def echo(mode: str, run_dir: str, n: int) -> None:
    ctx = zmq.Context()
    if mode == "push-pull":
        steps_ep, results_ep = _pair_endpoints(run_dir)
        inbox, outbox = Receiver(ctx, steps_ep, m.SchedulerToWorker, bind=False), Sender(ctx, results_ep)
    else:
        inbox = outbox = SchedulerLink(ctx, Endpoints(run_dir), 0, 0)
        outbox.send(m.WorkerHello(0, 0, "cpu", "bench", 1, 1, 1))
    ids, tokens = [f"r{i}" for i in range(n)], [5] * n
    while True:
        msg = inbox.recv()  # runs until the parent kills it, as a supervisor stops a worker
        outbox.send(m.StepResult(msg.step, 0, ids, tokens))


def round_trips(mode: str, n: int, steps: int) -> float:
    run_dir = str(make_run_dir())
    ctx = zmq.Context()
    if mode == "push-pull":
        steps_ep, results_ep = _pair_endpoints(run_dir)
        to_worker, results = Sender(ctx, steps_ep, bind=True), Receiver(ctx, results_ep, m.WorkerToScheduler)
        send = to_worker.send_bytes
    else:
        results = WorkerRouter(ctx, Endpoints(run_dir), 0, 1)
        send = results.broadcast
    child = subprocess.Popen([sys.executable, __file__, "--echo", mode, run_dir, str(n)])
    try:
        if mode != "push-pull":
            assert isinstance(results.recv(timeout_ms=30_000), m.WorkerHello)
        times = []
        for step in range(1, steps + 1):
            frame = step_frame(step, n)
            t0 = time.perf_counter()
            send(frame)
            result = results.recv(timeout_ms=30_000)
            times.append(time.perf_counter() - t0)
            assert result is not None and result.step == step
        return statistics.median(times[steps // 10:]) * 1e6
    finally:
        child.kill()
        child.wait(30)
        ctx.destroy(linger=0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--echo":
        echo(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    print("| decodes per step | push-pull µs | router-dealer µs |")
    print("|---|---|---|")
    for n in (1, 256, 4096):
        old, new = (round_trips(mode, n, args.steps) for mode in ("push-pull", "router-dealer"))
        print(f"| {n} | {old:.0f} | {new:.0f} |")


if __name__ == "__main__":
    main()
