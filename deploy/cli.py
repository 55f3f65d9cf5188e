"""The ``pagedserve`` command: serve, demo-model, replay, trace show, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pagedserve.clean_path import drop_working_directory
from pagedserve.deploy.serve_config import ConfigError, add_serve_args, serve_config_from_args
from pagedserve.deploy.vllm_compat import unsupported_flag
from pagedserve.protocol.version import package_version


def default_demo_dir() -> Path:
    base = os.environ.get("PAGEDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    return Path(base) / "demo-model"


def ensure_demo_model(path: Path | None = None) -> Path:
    from pagedserve.tools.demo_model import build_demo_model

    path = path or default_demo_dir()
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        logging.getLogger("pagedserve").info("writing the demo model to %s", path)
        build_demo_model(path)
    return path


def _cmd_serve(ns: argparse.Namespace) -> int:
    from pagedserve.deploy.supervisor import serve

    model = ns.model or str(ensure_demo_model())
    try:
        cfg = serve_config_from_args(ns, model)
    except ConfigError as exc:
        print(f"pagedserve serve: {exc}", file=sys.stderr)
        return 2
    if cfg.distributed_executor_backend == "ray":
        from pagedserve.deploy.ray.supervisor import serve_on_ray

        return serve_on_ray(cfg)
    return serve(cfg)


def _cmd_demo_model(ns: argparse.Namespace) -> int:
    from pagedserve.tools.demo_model import build_demo_model

    path = build_demo_model(ns.dir)
    print(f"wrote the demo model to {path}")
    return 0


def _cmd_replay(ns: argparse.Namespace) -> int:
    from pagedserve.tools.replay import replay_main

    return replay_main(ns)


def _cmd_trace_show(ns: argparse.Namespace) -> int:
    from pagedserve.tools.trace_show import show_main

    return show_main(ns)


def _cmd_bench(ns: argparse.Namespace) -> int:
    from pagedserve.bench.cli import bench_main

    return bench_main(ns)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve", description="A multi-process paged-attention LLM server.")
    p.add_argument("--version", action="version", version=f"pagedserve {package_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    add_serve_args(s)
    s.set_defaults(func=_cmd_serve)

    d = sub.add_parser("demo-model", help="write the demo model (small random Qwen2 + tokenizer)")
    d.add_argument("dir")
    d.set_defaults(func=_cmd_demo_model)

    r = sub.add_parser("replay", help="replay a recorded trace against fresh workers")
    r.add_argument("trace")
    r.add_argument("--model", help="model directory (default: the one recorded in the trace)")
    r.add_argument("--device", help="cpu or cuda (default: the kind the trace was recorded on)")
    r.add_argument("--num-threads", type=int, help="CPU threads per worker (results do not depend on it)")
    r.add_argument("--scheduler-only", action="store_true",
                   help="replay the frontend requests into a scheduler alone and compare its outputs")
    r.set_defaults(func=_cmd_replay)

    t = sub.add_parser("trace", help="inspect trace files")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    ts = tsub.add_parser("show", help="a readable summary of a trace")
    ts.add_argument("trace")
    ts.add_argument("--steps", action="store_true", help="one line per step")
    ts.add_argument("--requests", action="store_true", help="one line per request: arrival, first scheduled "
                    "step, first-token step, preemptions, finish")
    ts.set_defaults(func=_cmd_trace_show)

    b = sub.add_parser("bench", help="benchmarks")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    drop_working_directory()  # ``python -m pagedserve.deploy.cli`` on 3.10 (pagedserve/clean_path.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        complaint = unsupported_flag(argv[1:])
        if complaint is not None:
            print(f"pagedserve serve: {complaint}", file=sys.stderr)
            return 2
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
