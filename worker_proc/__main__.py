"""Entry point of one device's worker process: ``python -m pagedserve.worker_proc``."""

from __future__ import annotations

from pagedserve.clean_path import drop_working_directory

drop_working_directory()  # before anything imports transformers (pagedserve/clean_path.py)

from pagedserve.call_trace import record_on_signal  # noqa: E402

record_on_signal("worker")  # tools/request_path.py; off by default

import argparse
import gc
import logging
import faulthandler
import signal
import sys
from dataclasses import fields

from pagedserve.runtime.torch_env import apply_torch_env_defaults

apply_torch_env_defaults()  # before torch loads, below

from pagedserve.runtime import options as opts
from pagedserve.runtime.process_exit import exit_now
from pagedserve.protocol.model_architectures import ModelConfigError
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
    # The scheduler sends SIGUSR1 to a rank that missed its step deadline: every thread's
    # stack goes to stderr, the only way to see where a hung rank waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    keep_freed_memory()  # before the weights load: their temporaries' pages are reused by steps
    try:
        worker = Worker(cfg)
    except ModelConfigError as exc:  # (UnsupportedModelError is one) the operator's fix is in the message
        logging.getLogger("pagedserve.worker").error("cannot serve %s: %s", cfg.model, exc)
        return 2
    gc.freeze()  # the model and torch's own objects: keep collections proportional to a step
    try:
        worker.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        worker.close()
    # The caller ends the process without the interpreter's teardown (runtime/process_exit.py):
    # besides its cost, torch + gloo can abort in C++ static destructors at exit even after
    # destroy_process_group ("terminate called without an active exception").
    return 0


if __name__ == "__main__":
    exit_now(main())
