"""Entry point of one replica's scheduler process: ``python -m pagedserve.scheduler_proc``."""

from __future__ import annotations

from pagedserve.clean_path import drop_working_directory

drop_working_directory()  # before anything imports transformers (pagedserve/clean_path.py)

from pagedserve.call_trace import record_on_signal  # noqa: E402

record_on_signal("scheduler")  # tools/request_path.py; off by default

import argparse
import gc
import logging
import signal
import sys

from pagedserve.runtime.process_exit import exit_now
from pagedserve.protocol.trace import TraceError
from pagedserve.scheduler_proc.engine import EngineLoop
from pagedserve.scheduler_proc.engine_config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve.scheduler_proc", description=__doc__)
    EngineConfig.add_cli_args(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [scheduler {ns.replica}] %(message)s")
    try:
        cfg = EngineConfig.from_args(ns)
    except ValueError as exc:
        print(f"pagedserve scheduler: invalid configuration: {exc}", file=sys.stderr)
        return 2
    try:
        loop = EngineLoop(cfg)
    except TraceError as exc:  # --record-trace to a path that cannot be written: one line, not a traceback
        print(f"pagedserve scheduler: {exc}", file=sys.stderr)
        return 2

    def stop(signum, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    # Everything allocated so far lives for the whole process; keeping it out of the
    # collector's generations makes per-step collections proportional to the step.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        loop.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    exit_now(main())
