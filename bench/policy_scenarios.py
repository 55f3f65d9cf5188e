"""``pagedserve bench scenario priority|fair|deadline|shedding``: issue 32's goals, each policy
against ``fcfs`` on the same workload, through a server started here (HTTP, warm).

- ``priority``: 64 low-priority streams in a closed loop over ``--max-num-seqs 16``, and one
  high-priority request a second from a client process of its own: its TTFT p50 against its TTFT
  on an idle server (goal <= 3x), the scheduler's part of it from the run's trace (the idle
  requests count there too), and the same requests sent from the streams' own event loop.
- ``fair``: tenant A keeps 32 streams, B 4 (8x), together four times the machine's 8 seats: B's
  share of generated tokens (goal >= 45%; fcfs about 11%), B's TTFT p50 against B's 4 streams alone
  (goal <= 2x), and A alone under ``fair`` against A alone under ``fcfs`` (goal >= 95%). From each
  run's trace, B's requests in the scheduler: the share goal assumes B asks for more than its 4 seats.
- ``deadline``: a quarter of the requests carry a tight ``deadline_s``: the share of those that
  miss it (ended by it, or refused for waiting past it) (goal <= half of fcfs's) and total
  throughput (goal within 5%).
- ``shedding``: ``--max-waiting-requests``; the admitted streams' TPOT with and without a flood of
  extra requests, and how fast the flood's 429s come back (goal p99 <= 20 ms, TPOT within 10%).

Every request streams a completion of random token ids with ``ignore_eos``; the table prints each
measure under both policies and the goal.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from typing import Optional

import msgspec

from pagedserve.bench.report import stats
from pagedserve.bench.serve import _CHUNK, _JSON, first_model, http_session
from pagedserve.bench.servers import BenchServer, pagedserve_command
from pagedserve.deploy.entry_points import python_module

POLICY_SCENARIOS = ("priority", "fair", "deadline", "shedding")
# about 4x one request's run time on the demo model with 16 running (~40 ms), shorter than the
# queue in front of it under fcfs (48 waiting for 16 seats: ~3 request times)
TIGHT_DEADLINE_S = 0.15


class Run:
    """Per-request outcomes of one workload: (class, ttft, tokens, finish status) and timing."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.started = time.perf_counter()

    def of(self, cls: str) -> list[dict]:
        return [r for r in self.rows if r["cls"] == cls]


async def stream(client, model: str, run: Run, cls: str, prompt: list[int], max_tokens: int,
                 extra: Optional[dict] = None, headers: Optional[dict] = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, **(extra or {})}
    row = {"cls": cls, "ttft": None, "tokens": 0, "status": None, "finish": None, "times": []}
    sent = time.perf_counter()
    async with client.post("/v1/completions", data=_JSON.encode(body),
                           headers={"content-type": "application/json", **(headers or {})}) as resp:
        row["status"] = resp.status
        if resp.status == 200:
            pending = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                *events, pending = (pending + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    if b'"error"' in event[:12]:
                        row["finish"] = "error"
                        continue
                    chunk = _CHUNK.decode(event[6:])
                    if chunk.choices:
                        row["tokens"] += 1
                        row["times"].append(now)
                        if row["ttft"] is None:
                            row["ttft"] = now - sent
                    if b'"finish_reason":"' in event:
                        row["finish"] = event.split(b'"finish_reason":"')[1].split(b'"')[0].decode()
        else:
            await resp.read()
    row["e2e"] = time.perf_counter() - sent
    row["end"] = time.perf_counter() - run.started
    run.rows.append(row)
    return row


def _prompt(rng: random.Random, n: int = 32) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


async def closed_loop(client, model, run: Run, cls: str, until: float, rng, max_tokens: int, **kw) -> None:
    while time.perf_counter() < until:
        await stream(client, model, run, cls, _prompt(rng), max_tokens, **kw)


def _p50(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def _tokens_in(rows, t0: float, t1: float) -> int:
    return sum(1 for r in rows for t in r["times"] if t0 <= t < t1)


# ---------------------------------------------------------------------------------- workloads

async def priority_workload(url: str, policy: str, seconds: float) -> dict:
    """The high-priority requests go out twice a second, alternately from a client process of their
    own ("high") and from the 64 low streams' event loop ("high, same loop"): the first measures the
    server; the second also waits for that loop to parse the streams' thousands of events a second,
    which is what a single-process bench client adds on a loaded 2-core machine."""
    rng = random.Random(1)
    high = {"priority": 0}
    low = {} if policy == "fcfs" else {"priority": 10}
    async with http_session(url, 80) as client:
        model = await first_model(client)
        proc = await _start_side_process("probe", url, model)
        run = Run()
        idle = [await stream(client, model, run, "idle", _prompt(rng), 16, high) for _ in range(5)]
        until = time.perf_counter() + seconds
        loops = [asyncio.create_task(closed_loop(client, model, run, "low", until, rng, 64, extra=low))
                 for _ in range(64)]
        start = time.perf_counter() + 2.0  # the 64 streams fill the seats and the queue first
        proc.stdin.write(f"{start!r} {until - 2!r}\n".encode())
        await proc.stdin.drain()
        await asyncio.sleep(2.5)  # half a period after the probe process's first request
        highs = []
        while time.perf_counter() < until - 2:
            highs.append(asyncio.create_task(stream(client, model, run, "high, same loop", _prompt(rng), 16, high)))
            await asyncio.sleep(1.0)
        await asyncio.gather(*highs, *loops)
        run.rows += _JSON_ROWS.decode((await proc.communicate())[0])
    return {"idle_ttft_ms": 1e3 * _p50(r["ttft"] for r in idle[1:]),
            "high_ttft_p50_ms": 1e3 * _p50(r["ttft"] for r in run.of("high")),
            "high_same_loop_ttft_p50_ms": 1e3 * _p50(r["ttft"] for r in run.of("high, same loop")),
            "high_requests": len(run.of("high"))}


async def fair_workload(url: str, policy: str, seconds: float, a_streams: int = 32, b_streams: int = 4) -> dict:
    rng = random.Random(2)
    async with http_session(url, a_streams + b_streams + 4) as client:
        model = await first_model(client)
        run = Run()
        start = time.perf_counter()
        until = start + seconds
        loops = [asyncio.create_task(closed_loop(client, model, run, "a", until, rng, 96, extra={"user": "a"}))
                 for _ in range(a_streams)]
        loops += [asyncio.create_task(closed_loop(client, model, run, "b", until, rng, 96, extra={"user": "b"}))
                  for _ in range(b_streams)]
        await asyncio.gather(*loops)
    window = (start + 3.0, until)  # past the first admissions
    a, b = _tokens_in(run.of("a"), *window), _tokens_in(run.of("b"), *window)
    return {"a_tokens": a, "b_tokens": b, "b_share": b / max(1, a + b), "tok_s": (a + b) / (window[1] - window[0]),
            "b_ttft_p50_ms": 1e3 * _p50(r["ttft"] for r in run.of("b"))}


async def deadline_workload(url: str, policy: str, seconds: float) -> dict:
    rng = random.Random(3)
    async with http_session(url, 72) as client:
        model = await first_model(client)
        run = Run()
        start = time.perf_counter()
        until = start + seconds

        async def mixed(i: int) -> None:
            while time.perf_counter() < until:
                tight = rng.random() < 0.25
                await stream(client, model, run, "tight" if tight else "loose", _prompt(rng), 32,
                             {"deadline_s": TIGHT_DEADLINE_S} if tight else {})
        await asyncio.gather(*(mixed(i) for i in range(64)))
        wall = time.perf_counter() - start
    tight = run.of("tight")
    missed = [r for r in tight if r["status"] != 200 or r["finish"] in ("error", "abort") or r["tokens"] < 32]
    return {"tight": len(tight), "miss_rate": len(missed) / max(1, len(tight)),
            "tok_s": sum(r["tokens"] for r in run.rows) / wall}


async def shedding_workload(url: str, policy: str, seconds: float, limit: int, flood_process: bool = True) -> dict:
    """``flood_process``: the flood comes from a client process of its own, as refused clients are
    other clients than the admitted ones; False sends it from the admitted streams' event loop, where
    each 429's round trip also waits for that loop to parse the streams' ~14k events a second."""
    rng = random.Random(4)
    async with http_session(url, 200) as client:
        model = await first_model(client)
        proc = await _start_side_process("flood", url, model) if policy != "fcfs" and flood_process else None
        run = Run()
        until = time.perf_counter() + seconds
        # the admitted streams: the seats and a queue up to the limit
        loops = [asyncio.create_task(closed_loop(client, model, run, "admitted", until, rng, 48))
                 for _ in range(16 + limit)]
        flood = []
        if proc is not None:
            proc.stdin.write(f"{time.perf_counter() + 2.0!r} {until - 1!r}\n".encode())
            await proc.stdin.drain()
            await asyncio.gather(*loops)
            run.rows += _JSON_ROWS.decode((await proc.communicate())[0])
        elif policy != "fcfs":
            await asyncio.sleep(2.0)
            flood = await _flood(client, model, run, until - 1)
        await asyncio.gather(*loops, *flood)
    tpots = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in run.of("admitted")
             if len(r["times"]) > 1]
    refused = [r for r in run.of("flood") if r["status"] == 429]
    return {"admitted_tpot_ms": 1e3 * statistics.fmean(tpots) if tpots else float("nan"),
            "refused": len(refused), "flood": len(run.of("flood")),
            "refusal_p99_ms": 1e3 * stats([r["e2e"] for r in refused])["p99"] if refused else float("nan")}


async def _flood(client, model: str, run: Run, until: float) -> list:
    """One request every 20 ms (50 a second) until ``until``; the tasks, still running."""
    rng = random.Random(5)
    flood = []
    while time.perf_counter() < until:
        flood.append(asyncio.create_task(stream(client, model, run, "flood", _prompt(rng), 48)))
        await asyncio.sleep(0.02)
    return flood


async def _probe(client, model: str, run: Run, until: float) -> list:
    """One high-priority request a second until ``until``; the tasks, still running."""
    rng = random.Random(6)
    probes = []
    while time.perf_counter() < until:
        probes.append(asyncio.create_task(stream(client, model, run, "high", _prompt(rng), 16, {"priority": 0})))
        await asyncio.sleep(1.0)
    return probes


_SIDE_WORKLOADS = {"flood": (_flood, 200), "probe": (_probe, 8)}


async def _start_side_process(kind: str, url: str, model: str) -> asyncio.subprocess.Process:
    """A client process of its own for the flood or the high-priority probes, once its interpreter
    and HTTP client are up: a fresh interpreter on a loaded machine (a new venv's cold files) once
    took past a window fixed before it started, and flooded nothing. JSON over pipes, not
    multiprocessing: no pickle anywhere."""
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(*python_module("pagedserve.bench.policy_scenarios", kind, url, model),
                                                stdin=pipe, stdout=pipe)
    if await proc.stdout.readline() != b"ready\n":
        raise RuntimeError(f"the {kind} process did not start (exit {await proc.wait()})")
    return proc


def _side_process_main(kind: str, url: str, model: str) -> list[dict]:
    """The side workload from its own process, in the window its parent writes on stdin once this
    process said it is ready (perf_counter is the system's monotonic clock on Linux)."""
    workload, connections = _SIDE_WORKLOADS[kind]

    async def main() -> list[dict]:
        async with http_session(url, connections) as client:
            sys.stdout.buffer.write(b"ready\n")
            sys.stdout.buffer.flush()
            start, until = map(float, (await asyncio.to_thread(sys.stdin.readline)).split())
            run = Run()
            await asyncio.sleep(max(0.0, start - time.perf_counter()))
            await asyncio.gather(*await workload(client, model, run, until))
            return run.rows
    return asyncio.run(main())


_JSON_ROWS = msgspec.json.Decoder(list[dict])


# ---------------------------------------------------------------------------------- runner

def _serve(model: str, args: list[str], fn, *fn_args, trace=None) -> dict:
    """``trace``: a function of the run's recorded trace whose results join the workload's."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-policy-") as logs:
        path = f"{logs}/run.trace"
        extra = ("--record-trace", path) if trace else ()
        with BenchServer("pagedserve", lambda port: pagedserve_command(model, port, (*args, *extra)), logs) as server:
            result = asyncio.run(fn(server.url, *fn_args))
        if trace:
            result.update(trace(path))
        return result


def _trace_records(path: str):
    """(direction, decoded message) of a trace, for what the scenarios read from it."""
    from pagedserve.protocol import messages as m
    from pagedserve.protocol.codec import Decoder
    from pagedserve.protocol.trace import read_trace

    decoders = {"from_frontend": Decoder(m.FrontendToScheduler), "to_worker": Decoder(m.SchedulerToWorker),
                "from_worker": Decoder(m.WorkerToScheduler)}
    for direction, payload in read_trace(path).records:
        if direction in decoders:
            yield direction, decoders[direction].decode(payload)


def _requests_in_scheduler(path: str) -> dict:
    """Tenant B's requests in the scheduler (waiting or running), mean over the steps. B's share can
    reach a half only while this exceeds the 4 seats it is owed: below, B's streams spend longer
    between requests (HTTP round trips) than running them, and their own demand sets B's share."""
    from pagedserve.protocol import messages as m

    left: dict[str, int] = {}  # request id -> tokens still to sample (ignore_eos: it ends at max_tokens)
    b_ids: set[str] = set()
    steps = total = 0
    until = (0, 0)  # (steps, total) at the last arrival: the streams stop at the run's end, the queue drains
    for direction, msg in _trace_records(path):
        if isinstance(msg, m.AddRequest):
            left[msg.request_id] = msg.sampling.max_tokens
            if msg.tenant == "b":
                b_ids.add(msg.request_id)
            until = (steps, total)
        elif isinstance(msg, m.SchedulerOutput):
            steps += 1
            total += len(b_ids)
        elif isinstance(msg, m.StepResult) and msg.rank == 0:
            for rid in msg.req_ids:
                left[rid] -= 1
                if not left[rid]:
                    b_ids.discard(rid)
    return {"b_in_scheduler": until[1] / max(1, until[0])}


def _first_token_in_scheduler(path: str) -> dict:
    """p50 over priority-0 requests, from the trace's step clocks (``now_s``): from the step that
    stamped the request's arrival to the step after the one that sampled its first token (by when
    that token is out), so the scheduler's share of TTFT apart from HTTP."""
    from pagedserve.protocol import messages as m

    clocks: list[float] = []
    arrived: dict[str, int] = {}
    sampled: dict[str, int] = {}
    for direction, msg in _trace_records(path):
        if isinstance(msg, m.AddRequest) and msg.priority == 0:
            arrived[msg.request_id] = len(clocks)
        elif isinstance(msg, m.SchedulerOutput):
            clocks.append(msg.now_s)
            for r in msg.new_requests:
                if r.req_id in arrived and r.samples:
                    sampled.setdefault(r.req_id, len(clocks) - 1)
    spans = [clocks[sampled[rid] + 1] - clocks[step] for rid, step in arrived.items()
             if rid in sampled and sampled[rid] + 1 < len(clocks)]
    return {"scheduler_first_token_ms": 1e3 * statistics.median(spans) if spans else float("nan")}


def run_policy_scenario(ns: argparse.Namespace, model: str) -> dict:
    name, seconds = ns.name, ns.seconds
    base = ["--max-num-seqs", "8" if name == "fair" else "16", *ns.serve_args.split()]
    out: dict = {"scenario": name, "seconds": seconds}
    if name == "priority":
        for policy in ("fcfs", "priority"):
            out[policy] = _serve(model, [*base, "--scheduling-policy", policy], priority_workload, policy, seconds,
                                 trace=_first_token_in_scheduler)
        rows = [("idle TTFT ms", "idle_ttft_ms", "-"), ("high-priority TTFT p50 ms", "high_ttft_p50_ms", "-"),
                ("  / idle", None, "<= 3x"), ("  in the scheduler (trace) ms", "scheduler_first_token_ms", "-"),
                ("  sent from the streams' loop", "high_same_loop_ttft_p50_ms", "(the client's own lag)")]
        out["goal_ratio"] = out["priority"]["high_ttft_p50_ms"] / out["priority"]["idle_ttft_ms"]
        ratio = {p: out[p]["high_ttft_p50_ms"] / out[p]["idle_ttft_ms"] for p in ("fcfs", "priority")}
    elif name == "fair":
        a_streams, b_streams = getattr(ns, "fair_streams", (32, 4))
        for policy in ("fcfs", "fair"):
            out[policy] = _serve(model, [*base, "--scheduling-policy", policy], fair_workload, policy, seconds,
                                 a_streams, b_streams, trace=_requests_in_scheduler)
            out[policy + "_b_alone"] = _serve(model, [*base, "--scheduling-policy", policy],
                                              fair_workload, policy, seconds / 2, 0, b_streams)
            out[policy + "_a_alone"] = _serve(model, [*base, "--scheduling-policy", policy],
                                              fair_workload, policy, seconds / 2, a_streams, 0)
        for policy in ("fcfs", "fair"):
            out[policy]["b_ttft_vs_alone"] = out[policy]["b_ttft_p50_ms"] / out[policy + "_b_alone"]["b_ttft_p50_ms"]
            out[policy]["a_alone_tok_s"] = out[policy + "_a_alone"]["tok_s"]
        out["fair"]["a_alone_vs_fcfs"] = out["fair"]["a_alone_tok_s"] / out["fcfs"]["a_alone_tok_s"]
        rows = [("B share of tokens", "b_share", ">= 0.45 (fcfs ~0.11)"), ("B TTFT p50 ms", "b_ttft_p50_ms", "-"),
                ("  / B alone", "b_ttft_vs_alone", "<= 2x"), ("A alone tok/s", "a_alone_tok_s", "fair >= 0.95 fcfs"),
                ("B requests in the scheduler", "b_in_scheduler", ">= 4 (else B asks < half)")]
        ratio = None
    elif name == "deadline":
        for policy in ("fcfs", "deadline"):
            out[policy] = _serve(model, [*base, "--scheduling-policy", policy], deadline_workload, policy, seconds)
        rows = [("tight requests", "tight", "-"), ("miss rate", "miss_rate", "<= half of fcfs"),
                ("tok/s", "tok_s", "within 5%")]
        ratio = None
    else:
        limit = 16
        for label, policy in (("fcfs", "fcfs"), ("shedding", "shedding")):
            out[label] = _serve(model, [*base, "--max-waiting-requests", str(limit)], shedding_workload, policy,
                                seconds, limit, not getattr(ns, "flood_same_loop", False))
        rows = [("admitted TPOT ms", "admitted_tpot_ms", "within 10%"), ("flood requests", "flood", "-"),
                ("429s", "refused", "-"), ("429 p99 ms", "refusal_p99_ms", "<= 20")]
        ratio = None
    other = [k for k in out if k not in ("scenario", "seconds", "fcfs", "goal_ratio") and "_alone" not in k][0]
    detail = {"fair": f", A {getattr(ns, 'fair_streams', (32, 4))[0]} streams, B {getattr(ns, 'fair_streams', (32, 4))[1]}",
              "shedding": ", flood " + ("from the streams' event loop" if getattr(ns, "flood_same_loop", False)
                                        else "from a client process of its own")}.get(name, "")
    print(f"scenario {name}: {seconds:.0f} s per run, demo model, {' '.join(base)}{detail}")
    names = ("no flood", "flood") if name == "shedding" else ("fcfs", other)  # shedding: both --max-waiting-requests
    print(f"{'':<28}{names[0]:>14}{names[1]:>14}   goal")
    for label, key, goal in rows:
        if key is None:
            print(f"{label:<28}{ratio['fcfs']:13.2f}x{ratio[other]:13.2f}x   {goal}")
        else:
            print(f"{label:<28}{out['fcfs'][key]:14.3f}{out[other][key]:14.3f}   {goal}")
    return out


if __name__ == "__main__" and sys.argv[1:2] in (["flood"], ["probe"]):  # a workload's side process
    kind, url, model = sys.argv[1:4]
    sys.stdout.buffer.write(_JSON.encode(_side_process_main(kind, url, model)))
