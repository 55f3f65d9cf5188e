"""``pagedserve bench serve|offline|scenario``: parses the bench arguments and runs one benchmark."""

from __future__ import annotations

import argparse
import logging


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.bench import (lora as bench_lora, offline as bench_offline, peer as bench_peer,
                                  scenarios as bench_scenarios, serve as bench_serve)

    p = argparse.ArgumentParser(prog="pagedserve bench", description="pagedserve benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("serve", help="drive a running server through the OpenAI API")
    bench_serve.add_args(s)
    s.set_defaults(run=bench_serve.main)
    o = sub.add_parser("offline", help="offline LLM.generate against vLLM's LLM and transformers' generate_batch")
    bench_offline.add_args(o)
    o.set_defaults(run=bench_offline.main)
    c = sub.add_parser("scenario", help="named workloads: misaligned, tight-kv (seeds); priority, fair, "
                         "deadline, shedding (policies against fcfs)")
    bench_scenarios.add_args(c)
    c.set_defaults(run=bench_scenarios.main)
    v = sub.add_parser("peer", help="pagedserve, vLLM's server and `transformers serve --continuous-batching` "
                       "side by side over HTTP")
    bench_peer.add_args(v)
    v.set_defaults(run=bench_peer.main)
    lo = sub.add_parser("lora", help="many LoRA adapters against the base model alone (and vLLM's --enable-lora)")
    bench_lora.add_args(lo)
    lo.set_defaults(run=bench_lora.main)
    return p


def bench_main(ns: argparse.Namespace) -> int:
    args = build_parser().parse_args(list(getattr(ns, "bench_args", None) or []))
    for noisy in ("transformers", "httpx", "httpx2", "openai", "ContinuousBatchingLogger"):  # a line per HTTP request or CB step drowns the report
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return args.run(args)
