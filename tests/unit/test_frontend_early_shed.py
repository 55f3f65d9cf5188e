"""The 429 of --max-waiting-requests answered at the door (frontend_proc/early_shed.py): what a client
sees (status, Retry-After, the body the late path gives), that a shed request never reaches the app (no
routing, validation or tokenizing), the per-class counts, and every case that must still reach the app
(room somewhere, no live replica, a wrong key, a body it cannot judge). /v1/responses and /v1/messages
against the real app without the door: the same status, headers, body and counts. Pure ASGI calls: no process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from pagedserve.client.tokenization import PromptTokenizer
from pagedserve.frontend_proc.app import build_app
from pagedserve.frontend_proc.class_metrics import ShedCounts
from pagedserve.frontend_proc.early_shed import EarlyShed
from pagedserve.frontend_proc.engine_client import EngineClient, overloaded
from pagedserve.frontend_proc.metrics import FrontendMetrics
from pagedserve.client.router import Router
from pagedserve.frontend_proc.serving import Serving
from pagedserve.protocol.messages import SchedulerStats
from pagedserve.protocol.zmq_io import Endpoints, make_run_dir

LIMIT = 4


def _router(*waiting: int, state: str = "ready") -> Router:
    router = Router(len(waiting), timeout_s=60.0)
    for replica, n in enumerate(waiting):
        router.update(SchedulerStats(replica=replica, state=state, pid=10 + replica, num_running=2, num_waiting=n))
    return router


class App:
    """The app behind the layer: records each request and the body it read, answers 200."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _call(layer: EarlyShed, body: bytes, path: str = "/v1/completions", headers=(), chunks: int = 1):
    """One request through the layer: (status, headers, body) as the client gets them."""
    size = -(-len(body) // chunks)
    parts = [body[i * size:(i + 1) * size] for i in range(chunks)]
    messages = [{"type": "http.request", "body": p, "more_body": i < chunks - 1} for i, p in enumerate(parts)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    asyncio.run(layer(scope, receive, send))
    start, payload = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, payload


def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True, **fields}).encode()


def test_every_replica_full_is_refused_at_the_door_with_the_late_paths_429():
    router, app, shed = _router(LIMIT, LIMIT + 3), App(), ShedCounts()
    layer = EarlyShed(app, router, LIMIT, shed)
    status, headers, payload = _call(layer, _body(priority=0, user="alice"))
    assert status == 429
    assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(payload)
    error = json.loads(payload)["error"]
    assert error == overloaded(router, LIMIT).body()["error"]  # word for word what submit() raises
    assert error["code"] == "overloaded" and "--max-waiting-requests" in error["message"]
    assert "11 requests are waiting" in error["message"]
    assert app.bodies == []  # never routed, validated or tokenized
    # chat too, and the counts per class: the user field, then the key's hash, then the named header
    assert _call(layer, _body(priority=2), path="/v1/chat/completions",
                 headers=[("Authorization", "Bearer sk-x")])[0] == 429
    header_layer = EarlyShed(app, router, LIMIT, shed, tenant_header="X-Team")
    assert _call(header_layer, _body(user="bob"), headers=[("X-Team", "red")], chunks=3)[0] == 429
    assert app.bodies == []
    assert shed.total == 3
    assert shed.by_priority == {0: 2, 2: 1}
    assert set(shed.by_tenant) == {"alice", "red"} | {t for t in shed.by_tenant if t.startswith("key-")}
    assert len(shed.by_tenant) == 3


def test_room_on_any_live_replica_or_no_live_replica_goes_on_to_the_app():
    for router in (_router(LIMIT, LIMIT - 1), _router(0), _router(LIMIT, state="draining"), Router(1, 60.0)):
        app, shed = App(), ShedCounts()
        assert _call(EarlyShed(app, router, LIMIT, shed), _body())[0] == 200
        assert app.bodies == [_body()] and shed.total == 0
    app = App()  # no --max-waiting-requests: nothing is shed
    assert _call(EarlyShed(app, _router(100), None, ShedCounts()), _body())[0] == 200


def test_what_the_door_cannot_judge_reaches_the_app_with_its_body_intact():
    router = _router(LIMIT)
    app, shed = App(), ShedCounts()
    layer = EarlyShed(app, router, LIMIT, shed, api_key="secret")
    cases = [
        (_body(), "/v1/completions", []),  # no key: the app's 401
        (_body(), "/v1/completions", [("Authorization", "Bearer wrong")]),
        (b"{not json", "/v1/completions", [("x-api-key", "secret")]),  # the app's 400 naming the problem
        (_body(priority="high"), "/v1/completions", [("x-api-key", "secret")]),
        (_body(priority=10 ** 12), "/v1/chat/completions", [("x-api-key", "secret")]),
        (b"[1, 2]", "/v1/completions", [("x-api-key", "secret")]),
        (b"[1, 2]", "/v1/messages", [("x-api-key", "secret")]),
        (_body(), "/v1/messages/count_tokens", [("x-api-key", "secret")]),  # generates nothing
    ]
    for body, path, headers in cases:
        assert _call(layer, body, path=path, headers=headers, chunks=2)[0] == 200
    assert app.bodies == [body for body, _, _ in cases]
    assert shed.total == 0
    assert _call(layer, _body(), headers=[("Authorization", "Bearer secret")])[0] == 429
    assert _call(layer, _body(), headers=[("x-api-key", "secret")])[0] == 429
    assert shed.total == 2 and app.bodies == [body for body, _, _ in cases]


RESPONSES = {"model": "m", "input": "hello", "max_output_tokens": 4, "user": "carol"}
MESSAGES = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}


def test_responses_and_messages_are_refused_at_the_door_in_their_own_error_shapes():
    router, app, shed = _router(LIMIT + 1), App(), ShedCounts()
    layer = EarlyShed(app, router, LIMIT, shed, tenant_header="X-Team")
    status, headers, payload = _call(layer, json.dumps(MESSAGES).encode(), path="/v1/messages",
                                     headers=[("x-api-key", "sk-a"), ("anthropic-version", "2023-06-01")])
    assert (status, headers["retry-after"]) == (429, "1")
    message = overloaded(router, LIMIT).body()["error"]["message"]
    assert json.loads(payload) == {"type": "error", "error": {"type": "rate_limit_error", "message": message}}
    status, headers, payload = _call(layer, json.dumps(RESPONSES).encode(), path="/v1/responses",
                                     headers=[("X-Team", "red")], chunks=2)
    assert (status, headers["retry-after"]) == (429, "1")
    assert json.loads(payload) == overloaded(router, LIMIT).body()
    assert app.bodies == []
    # neither surface passes a priority or a user on to the chat request: priority 0, tenant by headers
    assert shed.by_priority == {0: 2} and shed.by_tenant == {"": 1, "red": 1}


async def _refusals(model_dir: str, tmp: str, door: bool, requests) -> tuple[list, ShedCounts]:
    """``requests`` through the real app (FastAPI, pydantic, the tokenizer, the router, submit()) with
    every replica full: each answer as (status, headers, body), and the app's shed counts."""
    router = _router(LIMIT)
    engine = EngineClient(Endpoints(make_run_dir(tmp)), router, LIMIT)
    metrics = FrontendMetrics(router, "m")
    app = build_app(Serving(["m"], 512, engine, PromptTokenizer(Path(model_dir)), metrics), router, metrics, None)
    if not door:
        app.user_middleware.clear()  # the refusal in submit(), as before the door
    asgi = app.build_middleware_stack()
    answers = []
    for path, body, headers in requests:
        payload = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(payload)).encode()),
                             *((k.lower().encode(), v.encode()) for k, v in headers)],
                 "client": ("127.0.0.1", 1), "server": None}
        messages = [{"type": "http.request", "body": payload, "more_body": False}]
        sent = []

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)

        await asgi(scope, receive, send)
        start = sent[0]
        answers.append((start["status"], sorted((k, v) for k, v in start["headers"] if k != b"content-length"),
                        b"".join(m.get("body", b"") for m in sent[1:])))
    await engine.close()
    return answers, metrics.shed


def test_the_door_answers_responses_and_messages_word_for_word_as_the_app_did(model_factory, tmp_path):
    requests = [("/v1/responses", RESPONSES, [("Authorization", "Bearer sk-b")]),
                ("/v1/messages", MESSAGES, [("x-api-key", "sk-a")]),
                ("/v1/messages", {**MESSAGES, "stream": True, "metadata": {"user_id": "u1"}}, [])]
    model = model_factory("qwen2")
    late, late_shed = asyncio.run(_refusals(model, str(tmp_path), False, requests))
    door, door_shed = asyncio.run(_refusals(model, str(tmp_path), True, requests))
    assert [status for status, _, _ in late] == [429] * 3
    assert door == late
    assert (door_shed.total, door_shed.by_tenant, door_shed.by_priority) == \
        (late_shed.total, late_shed.by_tenant, late_shed.by_priority)
