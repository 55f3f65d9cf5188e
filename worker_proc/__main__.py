"""Entry point of one device's worker process: ``python -m pagedserve.worker_proc``."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from dataclasses import fields

# Threads of a parallel op that wait at its end sleep instead of spinning (libgomp spins up
# to ~300k iterations by default). Read once when torch loads OpenMP, so set before the
# imports below. On 2 cores shared with the scheduler, the frontend and other processes,
# spinning threads took the cores the late thread needed: a 2-thread step of the small
# bench shape took 1.5 s spinning against 0.49 s sleeping (bench/RESULTS.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedserve.protocol import options as opts
from pagedserve.worker_proc.model_config import UnsupportedModelError
from pagedserve.worker_proc.host_memory import keep_freed_memory
from pagedserve.worker_proc.worker import Worker, WorkerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve.worker_proc", description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--dist-init", default=None)
    p.add_argument("--debug-sampling-seed-offset", type=int, default=0, help=argparse.SUPPRESS)
    opts.add_arguments(p, opts.WORKER)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [worker {ns.replica}.{ns.rank}] %(message)s")
    try:
        cfg = WorkerConfig(**{f.name: getattr(ns, f.name) for f in fields(WorkerConfig)})
    except ValueError as exc:
        print(f"pagedserve worker: invalid configuration: {exc}", file=sys.stderr)
        return 2

    def stop(signum, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    keep_freed_memory()  # before the weights load: their temporaries' pages are reused by steps
    try:
        worker = Worker(cfg)
    except UnsupportedModelError as exc:  # the operator's fix is in the message, not a traceback
        logging.getLogger("pagedserve.worker").error("cannot serve %s: %s", cfg.model, exc)
        return 2
    gc.freeze()  # the model and torch's own objects: keep collections proportional to a step
    try:
        worker.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        worker.close()
    if cfg.tensor_parallel_size > 1:
        # torch + gloo can abort in C++ static destructors at interpreter exit even after
        # destroy_process_group ("terminate called without an active exception"), turning
        # a clean stop into a crash report; everything is closed, so skip them.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
