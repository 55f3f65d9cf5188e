"""``serve --distributed-executor-backend ray`` on a real Ray cluster of three nodes on this
machine (``ray.cluster_utils.Cluster``): the head (no CPUs: the serve node) and two worker
nodes, each with room for two TP=1 replicas or one TP=2 replica. Run alone with ``pytest -m ray``.

One cluster and one DP=2 deployment serve the first tests in order: placement and parity,
then a lost node, then SIGTERM."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import ray  # the ray extra, part of the test extra: CI runs these

from support.oracle import hf_tokenizer
from support.server import Server, wait_until
from support.shadowing import assert_it_shadows, shadowing_cwd, unsafe_env
from support.greedy import assert_equal_to_transformers, client, greedy_completions


pytestmark = [pytest.mark.slow, pytest.mark.ray]

NODE_CPUS = 4  # two DP replicas (scheduler + worker each) would fit on one node: spreading is a choice
OBJECT_STORE = 80 * 2**20
SERVER_ARGS = ["--distributed-executor-backend", "ray", "--num-gpu-blocks", "512", "--max-model-len", "1200",
               "--replica-timeout-s", "3"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=False, object_store_memory=OBJECT_STORE))
    for _ in range(2):
        c.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def health(srv: Server) -> dict:
    return httpx.get(srv.url + "/health", timeout=5).json()


def deployment_pids(srv: Server) -> set[int]:
    body = health(srv)
    pids = {p["pid"] for r in body["replicas"] for p in r["processes"]}
    return pids | {p["pid"] for p in body["processes"]} | {body["supervisor_pid"]}


def our_groups_alive() -> list[str]:
    return [g["name"] for g in ray.util.placement_group_table().values()
            if g["name"].startswith("pagedserve-") and g["state"] != "REMOVED"]


@pytest.fixture(scope="module")
def dp2(cluster, model_factory, tmp_path_factory):
    srv = Server(model_factory("qwen2"), [*SERVER_ARGS, "--data-parallel-size", "2"],
                 env={"RAY_ADDRESS": cluster.address})
    srv.start(tmp_path_factory.mktemp("ray-dp2"), timeout_s=150)
    wait_until(lambda: all(r["live"] for r in health(srv)["replicas"]), 60)
    yield srv
    srv.stop()


def test_two_replicas_land_on_two_nodes_and_serve_transformers_greedy_tokens(dp2, cluster):
    replicas = health(dp2)["replicas"]
    workers = {n.node_id for n in cluster.worker_nodes}
    nodes = [r["node_id"] for r in replicas]
    assert nodes[0] != nodes[1] and set(nodes) <= workers, replicas  # never on the CPU-less serve node
    assert all(p["node_id"] == r["node_id"] for r in replicas for p in r["processes"])
    tok = hf_tokenizer(dp2.model)
    prompts = [tok(f"Request number {i} says hello").input_ids for i in range(16)]
    assert_equal_to_transformers(dp2.model, prompts, greedy_completions(dp2, prompts, 8), 8)


def stream(srv: Server, prompt: str, max_tokens: int, started) -> dict:
    """One streamed completion: tokens generated, and the error event (with when it came) if any."""
    out = {"tokens": 0, "error": None, "error_at": None}
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "model": client(srv).models.list().data[0].id, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"], out["error_at"] = event["error"]["message"], time.monotonic()
                continue
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
            started()
    return out


def test_a_lost_node_costs_only_its_replica_which_returns_when_a_node_is_added(dp2, cluster):
    lost_node = health(dp2)["replicas"][1]["node_id"]
    victim = next(n for n in cluster.worker_nodes if n.node_id == lost_node)
    max_tokens = 1000  # long enough to be cut on any machine: the node goes as soon as all have started
    started: set = set()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, dp2, f"Stream {i} goes on and on", max_tokens,
                               lambda i=i: started.add(i)) for i in range(8)]
        assert wait_until(lambda: len(started) == 8, 60)
        in_flight = health(dp2)["replicas"][1]["in_flight"]
        removed_at = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)
        # the other replica keeps serving while replica 1 is down
        assert wait_until(lambda: health(dp2)["replicas"][1]["state"] == "placing", 20), (health(dp2), dp2.log())
        tok = hf_tokenizer(dp2.model)
        prompts = [tok(f"While node {i} is gone").input_ids for i in range(4)]
        assert_equal_to_transformers(dp2.model, prompts, greedy_completions(dp2, prompts, 8), 8)
        results = [f.result() for f in futures]
    failed = [r for r in results if r["error"]]
    assert 0 < len(failed) <= in_flight, (results, dp2.log())
    assert all("replica 1" in r["error"] and r["error_at"] - removed_at < 10 for r in failed), (failed, dp2.log())
    assert all(r["tokens"] == max_tokens for r in results if not r["error"]), (results, dp2.log())
    body = health(dp2)
    assert body["replicas"][1]["live"] is False and body["replicas"][0]["live"] is True, body
    new_node = cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE)
    assert wait_until(lambda: health(dp2)["replicas"][1]["live"], 120), (health(dp2), dp2.log())
    # it had room beside replica 0 all along: it waited for a node of its own
    assert health(dp2)["replicas"][1]["node_id"] == new_node.node_id
    assert greedy_completions(dp2, prompts[:2], 4)[0][1] == 4


def test_sigterm_leaves_no_process_and_no_live_placement_group(dp2):
    pids = deployment_pids(dp2) | set(dp2.pids())
    assert len(pids) >= 6 and our_groups_alive(), (pids, dp2.log())
    dp2.proc.send_signal(15)
    assert dp2.proc.wait(60) == 0, dp2.log()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, (alive, dp2.log())
    assert our_groups_alive() == []


def test_tensor_parallel_pair_on_one_node_serves_transformers_greedy_tokens(cluster, model_factory, tmp_path):
    """A Llama, started from a directory that shadows an installed package (support/shadowing.py):
    the replica's processes on the Ray node import what is installed."""
    cwd = shadowing_cwd(tmp_path)
    assert_it_shadows(cwd)
    srv = Server(model_factory("llama"), [*SERVER_ARGS, "--tensor-parallel-size", "2"],
                 env=unsafe_env(RAY_ADDRESS=cluster.address), cwd=str(cwd), console_script=True)
    srv.start(tmp_path, timeout_s=150)
    try:
        replica = health(srv)["replicas"][0]
        assert {p["role"] for p in replica["processes"]} == {"scheduler", "worker"}
        assert len({p["node_id"] for p in replica["processes"]}) == 1, replica
        tok = hf_tokenizer(srv.model)
        prompts = [tok(p).input_ids for p in ("Hello, world!", "The quick brown fox jumps over the lazy dog")]
        try:
            completions = greedy_completions(srv, prompts, 10)
        except Exception as exc:  # the deployment's log (a late rank's stacks included) says why
            raise AssertionError(srv.log()) from exc
        assert_equal_to_transformers(srv.model, prompts, completions, 10)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
