"""Hostile input through a real deployment: fuzzed frames on every internal socket a
peer can reach, malformed HTTP of every kind, and the API key. Nothing crashes or hangs,
every bad input gets a clear rejection, and greedy tokens stay exactly right."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from support.oracle import hf_greedy, hf_tokenizer
from support.fault_helpers import completion, health, pid_of
from support.frame_fuzz import hostile_frames, oversized_frame
from support.server import Server, wait_until

from pagedserve.protocol import messages as m
from pagedserve.protocol.codec import encode
from pagedserve.protocol.worker_link import WorkerRouter
from pagedserve.protocol.zmq_io import Endpoints, Receiver, make_run_dir

pytestmark = pytest.mark.slow

KEY = "sk-fault-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
PROMPT = "The quick brown fox jumps over the lazy dog"
NO_DECODES = m.DecodeBatch([], [], [], [])


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    srv = Server(model_factory("qwen2"), ["--num-gpu-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
                                          "--api-key", KEY]).start(tmp_path_factory.mktemp("hostile"))
    yield srv
    srv.stop()


def greedy_text(srv: Server, max_tokens: int = 12) -> str:
    r = httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=60, json={
        "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def expected_text(srv: Server, max_tokens: int = 12) -> str:
    tok = hf_tokenizer(srv.model)
    return tok.decode(hf_greedy(srv.model, tok(PROMPT).input_ids, max_tokens), skip_special_tokens=True)


def all_pids(srv: Server) -> dict:
    return {role: pid_of(srv, role, -1 if role == "frontend" else 0) for role in ("frontend", "scheduler", "worker")}


def test_the_api_key_guards_every_endpoint_but_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"}, timeout=30)
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200


def all_processes(srv: Server) -> dict[str, psutil.Process]:
    procs = {role: psutil.Process(pid) for role, pid in all_pids(srv).items()}
    procs["supervisor"] = psutil.Process(srv.proc.pid)
    return procs


def rejected_totals(srv: Server, endpoint: str) -> int:
    """The running total the receiver last logged for ``endpoint`` (rate-limited lines)."""
    log = srv.log_path.read_text(errors="replace")
    found = re.findall(rf"rejected frame on {re.escape(endpoint)} \((\d+) total", log)
    return max(map(int, found), default=0)


def settled(count, timeout_s: float = 60) -> int:
    """``count()`` once it stopped changing for two seconds (the receiver caught up)."""
    last, stable_since, deadline = count(), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline and time.monotonic() - stable_since < 2:
        time.sleep(0.25)  # polling a log file another process writes
        now = count()
        if now != last:
            last, stable_since = now, time.monotonic()
    return last


def flood(endpoint: str, kind: int, frames: list[bytes]) -> tuple[int, int]:
    """Send every frame as fast as possible without waiting; returns (sent, dropped)."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sent = dropped = 0
    try:
        sock.connect(endpoint)
        for frame in frames:
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:  # the receiver's bounded queue is full: the flood is throttled
                dropped += 1
        sock.close(linger=30_000)  # hands over what is queued
    finally:
        ctx.term()
    return sent, dropped


def test_100k_fuzzed_frames_on_every_bound_socket_cost_bounded_memory_and_crash_nothing(server):
    assert wait_until(lambda: "supervisor_pid" in health(server)[1], 30)
    before_text, before_pids = greedy_text(server), all_pids(server)
    assert before_text == expected_text(server)
    (run_dir,) = Path(server.run_dir_parent).glob("pagedserve-*")
    ep = Endpoints(run_dir)
    # Every socket a deployment binds. The workers' ROUTER completes a handshake only with a
    # DEALER, and drops a DEALER whose routing id a worker did not mint before decoding.
    targets = {"scheduler_inputs": (ep.scheduler_inputs(0), zmq.PUSH),
               "worker_results": (ep.workers(0), zmq.DEALER),
               "frontend_outputs": (ep.frontend_outputs(), zmq.PUSH),
               "supervisor": (ep.supervisor(), zmq.PUSH)}
    procs = all_processes(server)
    rss_before = {role: p.memory_info().rss for role, p in procs.items()}
    report = {}
    for seed, (channel, (endpoint, kind)) in enumerate(targets.items()):
        before = rejected_totals(server, endpoint)
        sent, dropped = flood(endpoint, kind, hostile_frames(channel, 100_000, seed))
        flood(endpoint, kind, [oversized_frame()])  # the receiver drops the connection that sent it
        rejected = settled(lambda: rejected_totals(server, endpoint) - before)
        # Bit flips can make a valid (harmless) message, which is ignored, not rejected; a
        # ROUTER discards what a peer queued when it disconnects.
        assert rejected >= (0.5 if kind == zmq.DEALER else 0.9) * sent, (channel, sent, rejected)
        report[channel] = (sent, dropped)
    growth_mib = {role: (p.memory_info().rss - rss_before[role]) / (1 << 20) for role, p in procs.items()}
    print(f"\nflood (sent, dropped) per socket: {report}; RSS growth MiB: "
          + ", ".join(f"{r} {g:.1f}" for r, g in growth_mib.items()))
    assert all(g < 10 for g in growth_mib.values()), growth_mib
    assert wait_until(lambda: health(server)[0] == 200, 30)
    assert greedy_text(server) == before_text
    assert all_pids(server) == before_pids  # nothing crashed, nothing was restarted


def test_stray_peers_on_the_worker_socket_under_load_take_no_step_and_inject_no_result(server):
    """A stray PULL once took every other step; a stray PUSH could answer for a worker."""
    assert wait_until(lambda: health(server)[0] == 200, 30)
    worker = pid_of(server, "worker", 0)
    (run_dir,) = Path(server.run_dir_parent).glob("pagedserve-*")
    endpoint = Endpoints(run_dir).workers(0)
    prompts = [f"{PROMPT} {i}" for i in range(6)]
    tok = hf_tokenizer(server.model)
    expected = [tok.decode(hf_greedy(server.model, tok(p).input_ids, 24), skip_special_tokens=True) for p in prompts]
    ctx = zmq.Context()
    strays = {kind: ctx.socket(kind) for kind in (zmq.PULL, zmq.PUSH, zmq.DEALER)}
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = pool.map(lambda p: completion(server, p, 24, AUTH).json()["choices"][0]["text"], prompts)
            for sock in strays.values():
                sock.connect(endpoint)
            for step in range(1, 3000):  # fake results for every step number the load can reach
                fake = encode(m.StepResult(step, 0, [], []))
                for kind in (zmq.PUSH, zmq.DEALER):
                    try:
                        strays[kind].send(fake, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass
            texts = list(texts)
        assert texts == expected
        assert not strays[zmq.PULL].poll(500) and not strays[zmq.DEALER].poll(0)  # no step leaked
    finally:
        for sock in strays.values():
            sock.close(linger=0)
        ctx.term()
    assert pid_of(server, "worker", 0) == worker  # no step timed out, nothing restarted


def _malformed_requests(name: str) -> list[tuple[str, str, dict]]:
    """(method, path, httpx keyword arguments): each must get a 4xx with a JSON error."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    js = {"content-type": "application/json", **AUTH}
    ok_c = {"model": name, "prompt": "hi", "max_tokens": 2}
    ok_chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases: list[tuple[str, str, dict]] = []
    for raw in [b"{", b"[1, 2", b"\xff\xfe\x00", b"", b"null", b"123", b'"prompt"', b"[]", b"{}}",
                b'{"prompt": "hi",}', b"{'prompt': 'hi'}", b"NaN"]:
        cases += [("POST", c, {"content": raw, "headers": js}), ("POST", chat, {"content": raw, "headers": js})]
    wrong = {"prompt": [123.5, {"a": 1}, None, True, [[1], "a"], [["a"]]], "max_tokens": ["5", 2.5, True, [1]],
             "temperature": ["hot", [0], {}], "top_p": ["1", "x"], "n": ["2", 1.5],
             "stream": ["yes", 1], "stop": [5, [1, 2], {"s": 1}], "seed": ["x", 1.5], "logprobs": ["x", 2.5],
             "ignore_eos": ["no", 0], "top_k": ["3"], "min_tokens": ["1"], "stop_token_ids": ["1", [1.5]],
             "stream_options": ["x", {"include_usage": "yes"}], "model": [5, ["m"]]}
    for field, values in wrong.items():
        for value in values:
            cases.append(("POST", c, {"json": {**ok_c, field: value}, "headers": AUTH}))
    for value in ["hi", [{"role": 1, "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
                  [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], [], None, {}]:
        cases.append(("POST", chat, {"json": {**ok_chat, "messages": value}, "headers": AUTH}))
    for body in [{}, {"model": name}, {"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": ["a", ""]}]:
        cases.append(("POST", c, {"json": body, "headers": AUTH}))
    cases.append(("POST", chat, {"json": {"model": name}, "headers": AUTH}))
    out_of_range = {"max_tokens": [0, -1, 10**9, MAX_MODEL_LEN], "temperature": [-0.1, 2.5, 1e308],
                    "top_p": [0.0, 1.5, -1], "top_k": [-2, -100], "n": [0, -1, 10**6], "min_tokens": [-1, 10**6],
                    "logprobs": [-1, 100], "prompt": [[-1], [10**9], [2**70], [5] * (MAX_MODEL_LEN + 1)],
                    "echo": ["yes"], "suffix": ["x"]}  # echo itself is supported; no fill-in-the-middle
    for field, values in out_of_range.items():
        for value in values:
            cases.append(("POST", c, {"json": {**ok_c, field: value}, "headers": AUTH}))
    cases += [("POST", chat, {"json": {**ok_chat, "max_completion_tokens": 0}, "headers": AUTH}),
              ("POST", chat, {"json": {**ok_chat, "top_logprobs": 99, "logprobs": True}, "headers": AUTH})]
    for model in ["gpt-4", "", name + "x", name.upper() + "!"]:
        cases += [("POST", c, {"json": {**ok_c, "model": model}, "headers": AUTH}),
                  ("POST", chat, {"json": {**ok_chat, "model": model}, "headers": AUTH})]
    huge = {"prompt": "hello " * (MAX_MODEL_LEN * 4), "max_tokens": 2}
    cases += [("POST", c, {"json": {**ok_c, **huge}, "headers": AUTH}),
              ("POST", chat, {"json": {**ok_chat, "messages": [{"role": "user", "content": huge["prompt"]}]},
                              "headers": AUTH}),
              ("POST", c, {"json": {**ok_c, "prompt": list(range(5, 5 + 20 * MAX_MODEL_LEN))}, "headers": AUTH})]
    for method, path in [("GET", c), ("PUT", c), ("DELETE", chat), ("PATCH", chat), ("POST", "/v1/models"),
                         ("POST", "/health"), ("GET", "/v1/nope"), ("POST", "/v2/completions"),
                         ("GET", "/../../etc/passwd"), ("POST", c + "/extra"), ("GET", "/v1"), ("GET", "/")]:
        cases.append((method, path, {"json": ok_c, "headers": AUTH}))
    for ctype in ["text/plain", "application/x-www-form-urlencoded", "application/xml", "multipart/form-data"]:
        cases.append(("POST", c, {"content": b"prompt=hi&max_tokens=2", "headers": {"content-type": ctype, **AUTH}}))
    for headers in [{}, {"Authorization": "Bearer nope"}]:
        cases.append(("POST", c, {"json": ok_c, "headers": headers}))
    return cases


def test_500_malformed_http_requests_get_4xx_json_errors_and_serving_continues(server):
    name = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    kinds = _malformed_requests(name)
    assert len(kinds) > 120
    rng = random.Random(0)
    # The rest: random bytes, and random JSON objects that lack the one required field.
    path = lambda: rng.choice(["/v1/completions", "/v1/chat/completions"])  # noqa: E731
    junk_value = lambda: rng.choice([rng.random(), -rng.randrange(1 << 40), "x" * rng.randrange(50), None,  # noqa: E731
                                     [rng.random()], {"k": rng.randrange(9)}, True])
    fill = []
    for i in range(500 - len(kinds)):
        if i % 2:
            fill.append(("POST", path(), {"content": rng.randbytes(rng.randrange(1, 300)),
                                          "headers": {"content-type": "application/json", **AUTH}}))
        else:
            body = {rng.choice(["max_tokens", "n", "temperature", "stop", "model", "seed", "top_p", "x"]):
                    junk_value() for _ in range(rng.randrange(1, 5))}
            fill.append(("POST", path(), {"json": body, "headers": AUTH}))
    cases = kinds + fill

    def send(case):
        method, path, kwargs = case
        r = httpx.request(method, server.url + path, timeout=60, **kwargs)
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        return case, r.status_code, message, r.text[:200]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, cases))
    bad = [(case[0], case[1], str(case[2])[:120], status, text)
           for case, status, message, text in results if not (400 <= status < 500 and message)]
    assert not bad, bad[:5]
    assert greedy_text(server) == expected_text(server)


def test_a_worker_rejects_fuzzed_frames_on_its_input_and_still_samples_the_right_token(model_factory, tmp_path):
    """Stands in for the scheduler (the only peer that can reach a worker's input)."""
    model = model_factory("qwen2")
    run_dir = make_run_dir(str(tmp_path))
    ep = Endpoints(run_dir)
    ctx = zmq.Context()
    to_worker = results = WorkerRouter(ctx, ep, 0, tp_size=1)
    supervisor = Receiver(ctx, ep.supervisor(), m.ToSupervisor)
    log_path = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.worker_proc", "--run-dir", str(run_dir),
                             "--model", model, "--num-threads", "1"],
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    try:
        assert isinstance(results.recv(timeout_ms=120_000), m.WorkerHello)
        frames = hostile_frames("worker_inputs", 2000, seed=7)
        for frame in frames:
            to_worker.broadcast(frame)
        to_worker.broadcast(oversized_frame()[:-2])  # just under the limit, still garbage
        to_worker.broadcast(encode(m.WorkerInit(16, 8, 8, 64, 0)))
        assert isinstance(results.recv(timeout_ms=60_000), m.WorkerReady)
        tok = hf_tokenizer(model)
        prompt = tok(PROMPT).input_ids
        greedy = m.SamplingParams(max_tokens=1, temperature=0.0)
        blocks = list(range(-(-len(prompt) // 16)))
        to_worker.broadcast(encode(m.SchedulerOutput(1, [m.NewRequestData("r", prompt, len(prompt), blocks, 0, len(prompt),
                                                              greedy, True)], [], NO_DECODES, [], [], [], [], blocks,
                                         len(prompt))))
        result = results.recv(timeout_ms=60_000)
        assert result.error is None and result.sampled_token_ids == hf_greedy(model, prompt, 1)
        # Well-formed but impossible (a block the cache does not have): an error result, no crash.
        to_worker.broadcast(encode(m.SchedulerOutput(2, [m.NewRequestData("r2", prompt, len(prompt), [10**6], 0,
                                                              len(prompt), greedy, True)], [], NO_DECODES, [], [], [], [],
                                         [], 1)))
        result = results.recv(timeout_ms=60_000)
        assert result.step == 2 and result.error
        # A replayed (duplicated) step is refused, never run twice.
        to_worker.broadcast(encode(m.SchedulerOutput(2, [], [], NO_DECODES, [], [], [], [], [], 0)))
        result = results.recv(timeout_ms=60_000)
        assert result.step == 2 and "after step 2" in result.error
        assert proc.poll() is None

        def all_counted() -> bool:  # the log lines are rate-limited; an idle worker writes the total
            totals = re.findall(r"rejected frame on \S+ \((\d+) total", log_path.read_text(errors="replace"))
            return max(map(int, totals), default=0) >= len(frames)

        assert wait_until(all_counted, 10)
    finally:
        proc.kill()
        proc.wait()
        for s in (to_worker, supervisor):
            s.close()
        ctx.term()
