"""One data-parallel replica on Ray: its placement group, its bundle actors, its processes.

Bundles: ``[scheduler, worker 0, ..., worker TP-1]``, each asking for the CPUs (and, on
CUDA, the one GPU) its process uses, packed with STRICT_PACK so tensor parallelism never
crosses nodes. Replicas are spread by a label selector on every bundle that excludes the
nodes already holding another replica of this deployment (and nodes this deployment lost):
Ray offers no anti-affinity between placement groups, and a custom per-node resource
would make every operator configure it. On a one-node cluster the exclusion is dropped,
so ``ray.init()`` on a laptop still serves DP > 1.

``advance()`` never blocks: the supervisor calls it every loop turn. States:
queued -> placing -> locating (actors answer where they are) -> starting -> running; lost or
broken when an actor dies, stops answering, or its node lacks the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger("pagedserve.ray")

POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 5.0


class ModelMissingError(RuntimeError):
    """A node Ray chose has no model directory at the deployment's path."""


class RemoteProcess:
    """What the supervisor reads of a ``Popen``, for a process a bundle actor runs."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.returncode


@dataclass
class RemoteChild:
    """A ``deploy.children.Child`` whose process runs under a Ray actor, maybe on another node."""

    role: str
    replica: int
    rank: int
    popen: RemoteProcess
    actor: Any
    node: str
    stopping: Any = None  # the actor's answer to terminate(), once asked

    @property
    def name(self) -> str:
        return f"{self.role} {self.replica}.{self.rank} (pid {self.popen.pid} on Ray node {self.node[:12]})"

    def _wait_stopped(self, ref: Any, timeout_s: float) -> None:
        import ray

        try:
            code = ray.get(ref, timeout=timeout_s)
            self.popen.returncode = -9 if code is None else code
        except Exception:  # the actor or its node is gone: so is the process
            self.popen.returncode = -9

    def terminate(self) -> None:
        if self.popen.returncode is None and self.stopping is None:
            self.stopping = self.actor.stop.remote(STOP_GRACE_S)

    def kill(self) -> None:
        if self.popen.returncode is None:
            self._wait_stopped(self.actor.stop.remote(0.0), STOP_GRACE_S)

    def wait_or_kill(self, timeout_s: float) -> None:
        self.terminate()
        if self.popen.returncode is None:
            # the actor kills the process after STOP_GRACE_S; past that the actor is unreachable
            self._wait_stopped(self.stopping, max(timeout_s, STOP_GRACE_S) + 5)


class RayReplica:
    def __init__(self, replica: int, bundles: list[dict], host_class: Any,
                 model: str, run_dir_parent: Optional[str], lost_after_s: float):
        import ray

        self.replica = replica
        self.state = "queued"  # placed one at a time, so each knows where the others went
        self.since = time.monotonic()
        self.avoid_nodes: set[str] = set()
        self.warned = False  # about waiting long for a node
        self.error: Optional[str] = None
        self.lost_after_s = lost_after_s  # an actor silent this long is on a lost node
        self.sched_in: Optional[str] = None  # where the scheduler takes requests, once located
        self.pg = None
        self.placed_on: Optional[str] = None  # the node Ray reserved the bundles on
        self._ready_ref = None
        self._bundles = bundles
        self._host_class, self._model, self._run_dir_parent = host_class, model, run_dir_parent
        self.actors: list = []
        self.where: list[dict] = []
        self.children: list[RemoteChild] = []
        self._pending: list = []  # object refs of the current step
        self._poll_refs: list = []
        self._poll_sent = 0.0
        self._ray = ray

    @property
    def node_id(self) -> Optional[str]:
        return self.where[0]["node_id"] if self.where else self.placed_on

    def place(self, avoid_nodes: set[str]) -> None:
        from ray.util.placement_group import placement_group

        self.avoid_nodes = avoid_nodes
        selector = [{"ray.io/node-id": f"!in({','.join(sorted(avoid_nodes))})"}] * len(self._bundles) \
            if avoid_nodes else None
        self.pg = placement_group(self._bundles, strategy="STRICT_PACK", bundle_label_selector=selector,
                                  name=f"pagedserve-replica-{self.replica}-{int(time.time() * 1000)}")
        self._ready_ref = self.pg.ready()
        self.state, self.since = "placing", time.monotonic()

    def _all_done(self, refs: list) -> bool:
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(done) == len(refs)

    def advance(self, num_ports: int) -> Optional[str]:
        """Moves placement along; returns "locate" once the actors answered where they are."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.state == "placing" and self._all_done([self._ready_ref]):
            from ray.util.placement_group import placement_group_table

            self.placed_on = placement_group_table(self.pg)["bundles_to_node_id"][0]
            for index, bundle in enumerate(self._bundles):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)
                self.actors.append(self._host_class.options(
                    num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy).remote(self._model, self._run_dir_parent))
            self._pending = [a.where.remote(num_ports if i == 0 else 0) for i, a in enumerate(self.actors)]
            self.state = "locating"
        elif self.state == "locating" and self._all_done(self._pending):
            try:
                self.where = self._ray.get(self._pending)
            except Exception as exc:
                return self._lose(f"a bundle actor died while starting ({type(exc).__name__})")
            self._pending = []
            missing = [w for w in self.where if not w["has_model"]]
            if missing:
                w = missing[0]
                self.state, self.error = "broken", (
                    f"Ray node {w['node_id']} ({w['hostname']}, {w['ip']}) has no model directory "
                    f"{self._model} (no config.json): every node needs the model at the same path")
                raise ModelMissingError(self.error)
            return "locate"
        elif self.state == "starting" and self._all_done(self._pending):
            try:
                pids = self._ray.get(self._pending)
            except Exception as exc:
                return self._lose(f"a bundle actor died while starting its process ({type(exc).__name__})")
            self._pending = []
            node = self.node_id
            self.children = [RemoteChild("scheduler" if i == 0 else "worker", self.replica, max(0, i - 1),
                                         RemoteProcess(pid), actor, node)
                             for i, (pid, actor) in enumerate(zip(pids, self.actors))]
            self.state = "running"
            return "running"
        elif self.state == "running":
            self._watch()
        return None

    def start(self, commands: list[list[str]], files: list[dict[str, bytes]]) -> None:
        self._pending = [a.start.remote(cmd, f) for a, cmd, f in zip(self.actors, commands, files)]
        self.state = "starting"

    def restart_workers(self, commands: list[list[str]], files: list[dict[str, bytes]]) -> bool:
        """Fresh worker processes under the same actors; False when one of them is gone."""
        try:
            pids = self._ray.get([a.start.remote(c, f) for a, c, f in
                                  zip(self.actors[1:], commands, files)], timeout=30)
        except Exception:
            self._lose("a worker's bundle actor is gone")
            return False
        self._poll_refs = []  # answers about the processes just replaced
        for child, pid in zip(self.children[1:], pids):
            child.popen = RemoteProcess(pid)
        return True

    def _watch(self) -> None:
        """Exit codes from the actors; an actor that died or stopped answering is a lost node."""
        now = time.monotonic()
        if self._poll_refs:
            if self._all_done(self._poll_refs):
                try:
                    codes = self._ray.get(self._poll_refs)
                except Exception as exc:
                    self._lose(f"a bundle actor died ({type(exc).__name__})")
                    return
                self._poll_refs = []
                for child, code in zip(self.children, codes):
                    if code is not None and child.popen.returncode is None:
                        child.popen.returncode = code
            elif now - self._poll_sent > self.lost_after_s:
                self._lose(f"its bundle actors have not answered for {now - self._poll_sent:.1f}s")
        elif now - self._poll_sent >= POLL_INTERVAL_S:
            self._poll_refs = [a.poll.remote() for a in self.actors]
            self._poll_sent = now

    def _lose(self, reason: str) -> None:
        if self.state != "lost":
            log.error("replica %d: Ray node %s lost: %s", self.replica, self.node_id, reason)
        self.state = "lost"
        self.error = reason
        for child in self.children:
            if child.popen.returncode is None:
                child.popen.returncode = -9
        return None

    def teardown(self) -> None:
        """Kills the actors (their processes die with them) and removes the placement group."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self._ray.kill(actor)
            except Exception:
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        self.actors, self.children = [], []
