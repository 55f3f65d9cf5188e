"""The Ray backend's options without a Ray cluster: the install hint, refused combinations, and
the KubeRay manifest in deploy/k8s (the checks deploy/k8s/raycluster.yaml claims)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from pagedserve.deploy import cli
from pagedserve.deploy.serve_config import ConfigError, ServeConfig

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "raycluster.yaml"


def test_without_ray_installed_the_flag_answers_with_one_line_saying_how_to_install_it(
        model_factory, monkeypatch, capsys):
    model = model_factory("qwen2")
    capsys.readouterr()  # building the model writes progress bars
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets when it is not installed
    assert cli.main(["serve", model, "--distributed-executor-backend", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'pip install -e ".[ray]"' in err, err


def test_ray_places_every_process_itself_so_hand_placement_options_are_refused(model_factory):
    model = model_factory("qwen2")
    with pytest.raises(ConfigError, match="--remote-workers"):
        ServeConfig(model=model, distributed_executor_backend="ray", remote_workers=True)
    with pytest.raises(ConfigError, match="--internal-host"):
        ServeConfig(model=model, distributed_executor_backend="ray", internal_host="10.0.0.7",
                    internal_port_base=31000)


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def test_the_kuberay_manifest_runs_a_serve_command_that_parses_and_fits_its_worker_groups():
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    cluster = next(d for d in docs if d["kind"] == "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    head, groups = spec["headGroupSpec"], spec["workerGroupSpecs"]
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in groups]:
        assert all(isinstance(v, str) for v in params.values())  # the CRD's map of strings
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica on the serve node
    serve = next(c for c in _containers(head["template"]) if c.get("command", [])[:2] == ["pagedserve", "serve"])
    ns = cli.build_parser().parse_args(serve["command"][1:])
    assert ns.distributed_executor_backend == "ray" and ns.device == "cuda"
    gpu_group = groups[0]
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    assert gpu_group["replicas"] >= ns.data_parallel_size  # one pod per replica: spread over nodes
    worker = _containers(gpu_group["template"])[0]
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == ns.tensor_parallel_size
    # the model at the same path in every Ray container, and the serve command's model under it
    ray_containers = [c for c in _containers(head["template"])] + [worker]
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]}["models"] for c in ray_containers]
    assert len(set(mounts)) == 1 and ns.model.startswith(mounts[0] + "/")
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] == ns.port


def test_the_request_relay_follows_a_replica_to_its_new_node_and_drops_frames_while_it_has_none(tmp_path):
    import zmq

    from pagedserve.deploy.ray.relay import InputRelay
    from pagedserve.protocol.zmq_io import Endpoint

    ctx = zmq.Context()
    relay = InputRelay(ctx, {0: Endpoint(f"ipc://{tmp_path}/relay-in.sock")})
    relay.start()
    frontend = ctx.socket(zmq.PUSH)
    frontend.connect(f"ipc://{tmp_path}/relay-in.sock")
    nodes = []
    for name in ("old-node", "new-node"):
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"ipc://{tmp_path}/{name}.sock")
        nodes.append(sock)
    try:
        relay.point(0, Endpoint(f"ipc://{tmp_path}/old-node.sock"))
        frontend.send(b"first")
        assert nodes[0].poll(5000) and nodes[0].recv() == b"first"
        relay.point(0, None)  # lost: nobody waits for what is sent meanwhile
        frontend.send(b"lost")
        relay.point(0, Endpoint(f"ipc://{tmp_path}/new-node.sock"))
        frontend.send(b"second")
        received = []
        while b"second" not in received and nodes[1].poll(5000):
            received.append(nodes[1].recv())
        assert received[-1:] == [b"second"]  # ("lost" may get through if still in flight: deploy/ray/relay.py)
        assert not nodes[0].poll(200)  # the old node never hears of the replica again
    finally:
        relay.stop()
        for sock in [frontend, *nodes]:
            sock.close(linger=0)
        ctx.term()
