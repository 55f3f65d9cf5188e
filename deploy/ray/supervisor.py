"""``pagedserve serve --distributed-executor-backend ray``: the supervisor, with replicas on Ray.

The frontend (and this supervisor, Ray's driver) stay on the node where ``serve`` runs.
Each data-parallel replica is a placement group (deploy/ray/placement.py) whose bundle
actors run the same scheduler and worker command lines as the local supervisor
(deploy/ray/host.py). Every internal socket is TCP with CurveZMQ; the keys and each
process's endpoint layout travel to the nodes as actor arguments, never through a shared
filesystem. A replica's request channel is relayed from a fixed serve-node address to
wherever the replica runs now (deploy/ray/relay.py), so a replica placed again on another
node needs no frontend restart.

Restarts, the restart budget, /health publishing and draining are the local supervisor's
(deploy/supervisor.py); a lost node is one more way for a replica's processes to exit.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from pagedserve.deploy.children import free_tcp_port
from pagedserve.deploy.ray.placement import ModelMissingError, RayReplica
from pagedserve.deploy.ray.relay import InputRelay
from pagedserve.deploy.serve_config import ServeConfig
from pagedserve.deploy.supervisor import PUBLISH_INTERVAL_S, StartupError, Supervisor, serve
from pagedserve.protocol import messages as m
from pagedserve.protocol.curve import CURVE_DIR
from pagedserve.protocol.zmq_io import LAYOUT_FILE, TcpLayout

log = logging.getLogger("pagedserve.ray")

INSTALL_HINT = 'pip install -e ".[ray]"'
SCHEDULER_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")
WORKER_FILES = ("server.key", "client.key_secret")  # a worker only connects (protocol/curve.py)
REPLICA_PORTS = 3  # on the replica's node: requests in, the worker channel, torch.distributed
PLACING_WARN_S = 30.0


class RaySupervisor(Supervisor):
    def __init__(self, cfg: ServeConfig):
        import ray

        from pagedserve.deploy.ray.host import remote_class

        self.serve_ip = ray.util.get_node_ip_address()
        self.serve_ports = [free_tcp_port(self.serve_ip) for _ in range(2 + cfg.data_parallel_size)]
        if cfg.device == "cpu" and not cfg.num_threads:
            cfg.num_threads = 1  # the CPUs each worker bundle asks Ray for
        self.host_class = remote_class()
        self.ray_replicas: dict[int, RayReplica] = {}
        self.lost_nodes: set[str] = set()
        self.starting_up = True
        super().__init__(cfg)
        curve_dir = Path(self.run_dir) / CURVE_DIR
        self.keys = {name: (curve_dir / name).read_bytes() for name in SCHEDULER_FILES}
        self.relay = InputRelay(self.ctx, {r: self.ep.scheduler_inputs(r) for r in range(cfg.data_parallel_size)})
        self.relay.start()

    def _address(self, index: int) -> str:
        return f"tcp://{self.serve_ip}:{self.serve_ports[index]}"

    def _serve_addresses(self) -> dict[str, str]:
        return {"supervisor": self._address(0), "frontend-out": self._address(1)}

    def _layout(self) -> Optional[TcpLayout]:
        relays = {f"sched{r}-in": self._address(2 + r) for r in range(self.cfg.data_parallel_size)}
        # port_base is unused: every endpoint the serve node's processes open is named.
        return TcpLayout(self.serve_ip, 1, self.cfg.tensor_parallel_size, self.cfg.data_parallel_size,
                         curve=True, addresses={**self._serve_addresses(), **relays})

    # ------------------------------------------------------------------ placement

    def _bundles(self) -> list[dict]:
        worker = {"CPU": float(self.cfg.num_threads or 1)}
        if self.cfg.device.startswith("cuda"):
            worker["GPU"] = 1.0
        return [{"CPU": 1.0}] + [dict(worker) for _ in range(self.cfg.tensor_parallel_size)]

    def _avoid_nodes(self, replica: int) -> set[str]:
        import ray

        if sum(1 for n in ray.nodes() if n.get("Alive")) <= 1:
            return set()  # one node: replicas share it (see placement.py)
        others = {rr.node_id for r, rr in self.ray_replicas.items()
                  if r != replica and rr.node_id and rr.state != "lost"}
        return others | self.lost_nodes

    def _spawn_replica(self, replica: int) -> None:
        old = self.ray_replicas.pop(replica, None)
        if old is not None:
            old.teardown()
        self.schedulers.pop(replica, None)
        self.workers.pop(replica, None)
        self.relay.point(replica, None)
        self.ray_replicas[replica] = RayReplica(replica, self._bundles(), self.host_class, self.cfg.model,
                                                self.cfg.run_dir_parent, self.cfg.replica_timeout_s)

    def _place_next(self) -> None:
        """One placement group in flight at a time: a replica placed while another is still
        being placed could not avoid that one's node."""
        if any(rr.state == "placing" for rr in self.ray_replicas.values()):
            return
        queued = [r for r, rr in sorted(self.ray_replicas.items()) if rr.state == "queued" and r not in self.failed]
        if queued:
            self.ray_replicas[queued[0]].place(self._avoid_nodes(queued[0]))
            log.info("replica %d: waiting for Ray to place %s (STRICT_PACK)", queued[0], self._bundles())

    def _replica_files(self, replica: int, rr: RayReplica) -> tuple[list[dict], Optional[str]]:
        where = rr.where[0]
        port_in, port_workers, port_dist = where["ports"]
        addresses = {**self._serve_addresses(),
                     f"sched{replica}-in": f"tcp://{where['ip']}:{port_in}",
                     f"sched{replica}-workers": f"tcp://{where['ip']}:{port_workers}"}
        layout = TcpLayout(self.serve_ip, 1, self.cfg.tensor_parallel_size, self.cfg.data_parallel_size,
                           curve=True, addresses=addresses)
        layout_bytes = json.dumps(asdict(layout)).encode()
        rr.sched_in = addresses[f"sched{replica}-in"]

        def files(names) -> dict[str, bytes]:
            return {LAYOUT_FILE: layout_bytes, **{f"{CURVE_DIR}/{n}": self.keys[n] for n in names}}

        dist_init = f"tcp://127.0.0.1:{port_dist}" if self.cfg.tensor_parallel_size > 1 else None
        return [files(SCHEDULER_FILES)] + [files(WORKER_FILES)] * self.cfg.tensor_parallel_size, dist_init

    def _worker_cmds(self, replica: int, dist_init: Optional[str]) -> list[list[str]]:
        return [self.cfg.worker_cmd(self.run_dir, replica, rank, dist_init)
                for rank in range(self.cfg.tensor_parallel_size)]

    def _spawn_workers(self, replica: int) -> None:
        rr = self.ray_replicas.get(replica)
        if rr is None or rr.state != "running":
            return
        files, dist_init = self._replica_files(replica, rr)
        if rr.restart_workers(self._worker_cmds(replica, dist_init), files[1:]):
            self.workers[replica] = rr.children[1:]

    def _tick(self) -> None:
        self._place_next()
        for replica, rr in list(self.ray_replicas.items()):
            if replica in self.failed:
                if rr.actors:
                    rr.teardown()
                continue
            if rr.state == "placing" and not rr.warned and time.monotonic() - rr.since > PLACING_WARN_S:
                rr.warned = True
                log.warning("replica %d: Ray has not placed %s (STRICT_PACK, avoiding nodes %s) for %.0fs: "
                            "the cluster needs a node with that much free beside the other replicas",
                            replica, self._bundles(), sorted(rr.avoid_nodes) or "none", PLACING_WARN_S)
            try:
                step = rr.advance(REPLICA_PORTS)
            except ModelMissingError as exc:
                if self.starting_up:
                    raise StartupError(str(exc)) from None
                log.error("replica %d: %s; marking it failed", replica, exc)
                self.failed.add(replica)
                continue
            if step == "locate":
                files, dist_init = self._replica_files(replica, rr)
                rr.start([self.cfg.scheduler_cmd(self.run_dir, replica)] + self._worker_cmds(replica, dist_init),
                         files)
            elif step == "running":
                self.schedulers[replica] = rr.children[0]
                self.workers[replica] = rr.children[1:]
                self.last_heartbeat[replica] = time.monotonic()
                self.relay.point(replica, rr.sched_in)
                log.info("replica %d: running on Ray node %s (%s)", replica, rr.node_id, rr.where[0]["ip"])
            if rr.state == "lost":
                if rr.node_id:
                    self.lost_nodes.add(rr.node_id)
                if replica not in self.schedulers:  # lost before it ran: nobody else notices
                    self._schedule_restart(replica, "replica", rr.error or "lost while starting")

    def start(self, timeout_s: float = 600.0) -> None:
        super().start(timeout_s)
        self.starting_up = False

    def _publish(self) -> None:
        if time.monotonic() - self.last_publish >= PUBLISH_INTERVAL_S:
            for replica in self.ray_replicas:
                if replica not in self.failed and replica not in self.schedulers:
                    self.to_frontend.try_send(m.SchedulerStats(replica=replica, state="placing"))
        super()._publish()

    def _stop_children(self) -> None:
        super()._stop_children()
        for rr in self.ray_replicas.values():
            rr.teardown()
        self.relay.stop()


def serve_on_ray(cfg: ServeConfig) -> int:
    try:
        import ray
    except ImportError:
        print(f"pagedserve serve: --distributed-executor-backend ray needs Ray: {INSTALL_HINT}", file=sys.stderr)
        return 2
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address)
        else:
            ray.init(include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"pagedserve serve: cannot join the Ray cluster at {address or '(local)'}: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(cfg, RaySupervisor)
    finally:
        ray.shutdown()
