"""`pdserve ray scale`: change a running Ray deployment's worker counts while it serves.

A new worker is one more detached ``WorkerActor`` of its role, started from the spec an existing
worker of that role was started with (``launch_spec``: engine and worker flags, file paths of
the secrets, its CPUs/GPUs and whether it is pinned to the head node), named after the next
index (``NAME-decode-2``). Once it answers, the router is told through its membership API
(``AddWorker``, with the cluster token) and follows the actor by name across Ray restarts
(``RouterActor.follow``). A worker taken away is drained and removed through the membership API
first (``RemoveWorker``: in-flight requests finish or move elsewhere, nothing is lost), then
stopped for good (``WorkerActor.stop``). Added workers live outside the deployment's placement
group: the cluster must have room for them beside it.

Before anything starts, the internal plane's rule (``require_secure_internal_plane``) is applied
to what scaling reaches: the router it proves the cluster token to, and the address the new
workers bind (``node-ip`` is not loopback). Off loopback that needs the deployment's mutual TLS,
or ``--insecure-internal-plane``.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.services.common.security import require_secure_internal_plane
from pdserve.services.common.topology import DRAIN_TIMEOUT_S
from pdserve.services.ray_deploy.deploy import HEAD_RESOURCE, PIN, admin_token_file, list_actors

ROLES = ("prefill", "decode")
START_TIMEOUT_S = 180.0


class ScaleError(RuntimeError):
    pass


@dataclass(slots=True)
class ScaleResult:
    added: list[str] = field(default_factory=list)     # actor names
    removed: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"added: {', '.join(self.added) or 'none'}; removed: {', '.join(self.removed) or 'none'}")


def _index(actor: str) -> int:
    return int(actor.rsplit("-", 1)[1])


def _workers(name: str, namespace: str) -> dict[str, list[str]]:
    """The deployment's worker actor names by role, in index order."""
    present = list_actors(name, namespace)
    out: dict[str, list[str]] = {role: [] for role in ROLES}
    for actor in present:
        match = re.fullmatch(rf"{re.escape(name)}-(prefill|decode)-\d+", actor)
        if match:
            out[match.group(1)].append(actor)
    for role in ROLES:
        out[role].sort(key=_index)
    return out


def check_plane(credentials, router: str, templates: dict[str, dict[str, Any]], insecure_plane: bool) -> None:
    """`ray scale` reaches the router (membership calls) and has new workers bind their role's
    host: past loopback, only with mutual TLS or --insecure-internal-plane (ValueError naming them)."""
    binds = tuple(sorted({str(t.get("host") or "") for t in templates.values()}))
    require_secure_internal_plane(credentials, "ray scale", binds=binds, dials=(router,),
                                  insecure_plane=insecure_plane)


def scale(name: str, namespace: str, want: dict[str, int | None], drain_timeout_s: float = 0.0,
          timeout_s: float = START_TIMEOUT_S, insecure_plane: bool = False) -> ScaleResult:
    """Bring each role of want to its count (None: leave it), adding before removing, one worker
    at a time. insecure_plane: --insecure-internal-plane (see check_plane). Raises ScaleError,
    saying what was done until then."""
    import ray

    from pdserve.services.ray_deploy.actors import control_proof, load_credentials   # lazy: ray only when this runs

    for role, count in want.items():
        if count is not None and count < 1:
            raise ValueError(f"{role}_workers must be >= 1, got {count}")
    workers = _workers(name, namespace)
    if not any(workers.values()):
        raise ScaleError(f"no deployment {name!r} in namespace {namespace!r}")
    router = ray.get_actor(f"{name}-router", namespace=namespace)
    router_info = ray.get(router.info.remote(), timeout=30)
    template = {role: json.loads(ray.get(ray.get_actor(actors[0], namespace=namespace).launch_spec.remote(),
                                         timeout=30)) for role, actors in workers.items() if actors}
    admin_file = admin_token_file(name, namespace)
    credentials = load_credentials({**next(iter(template.values())), "admin_token_file": admin_file})
    check_plane(credentials, router_info["address"], template, insecure_plane)
    membership = _Membership(router_info["address"], credentials)
    result = ScaleResult()
    try:
        for role in ROLES:   # grow first: capacity arrives before any leaves
            count = want.get(role)
            next_index = max((_index(a) for a in workers[role]), default=-1) + 1
            for i in range(next_index, next_index + max(0, (count or 0) - len(workers[role]))):
                actor = f"{name}-{role}-{i}"
                address = _start_worker(template[role], actor, namespace, timeout_s)
                membership.add(address, role)
                ray.get(router.follow.remote(actor, control_proof(credentials, f"{name}-router", "follow")),
                        timeout=60)
                result.added.append(actor)
        for role in ROLES:
            count = want.get(role)
            extra = workers[role][count:] if count is not None else []
            for actor in reversed(extra):
                handle = ray.get_actor(actor, namespace=namespace)
                address = ray.get(handle.address.remote(), timeout=30)
                membership.remove(address, drain_timeout_s)
                _stop(handle, control_proof(credentials, actor, "stop"))
                result.removed.append(actor)
    except Exception as exc:
        raise ScaleError(f"{exc} ({result.describe()} so far)") from exc
    return result


def _stop(handle, proof: str) -> None:
    """Drain and end the actor for good: its stop() exits the actor, so the call ends with the
    actor's (intended) death."""
    import ray
    try:
        ray.get(handle.stop.remote(proof), timeout=60)
    except ray.exceptions.RayActorError:
        pass


def _start_worker(template: dict[str, Any], actor: str, namespace: str, timeout_s: float) -> str:
    """Start a WorkerActor from template under the name actor; its address once it serves."""
    import ray

    from pdserve.services.ray_deploy.actors import WorkerActor   # lazy: ray only when this runs

    place = template.get("placement") or {}
    env = place.get("log_level_env") or {}
    handle = WorkerActor.options(
        name=actor, namespace=namespace, lifetime="detached", max_restarts=place.get("max_restarts", -1),
        num_cpus=place.get("num_cpus", 1), num_gpus=place.get("num_gpus", 0),
        resources={HEAD_RESOURCE: PIN} if place.get("on_head") else None,
        runtime_env={"env_vars": env} if env else None,
    ).remote(json.dumps({**template, "name": actor}))
    try:
        return ray.get(handle.address.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(handle, no_restart=True)
        raise ScaleError(f"{actor} did not start within {timeout_s:g}s: has the cluster room for another worker "
                         f"of {place.get('num_cpus', 1):g} CPU(s) beside the deployment?") from None
    except ray.exceptions.RayError:
        ray.kill(handle, no_restart=True)
        raise


class _Membership:
    """The router's membership API, with the deployment's cluster token."""

    def __init__(self, router: str, credentials) -> None:
        self.router, self.credentials = router, credentials

    def _call(self, method: str, request, timeout: float):
        from pdserve.v1 import membership_pb2_grpc
        with self.credentials.sync_channel(self.router) as channel:
            return getattr(membership_pb2_grpc.MembershipStub(channel), method)(request, timeout=timeout)

    def add(self, address: str, role: str) -> None:
        from pdserve.v1 import membership_pb2, worker_pb2
        enum = worker_pb2.WORKER_ROLE_PREFILL if role == "prefill" else worker_pb2.WORKER_ROLE_DECODE
        member = self._call("AddWorker", membership_pb2.AddWorkerRequest(address=address, role=enum), 60)
        deadline = time.monotonic() + 60
        while member.state != membership_pb2.MEMBER_STATE_SERVING:   # routed to from now on
            if time.monotonic() > deadline:
                raise ScaleError(f"the router does not route to {address} yet: {membership_pb2.MemberState.Name(member.state)}")
            time.sleep(0.2)
            member = next((m for m in self._call("ListWorkers", membership_pb2.ListWorkersRequest(), 30).workers
                           if m.address == address), member)

    def remove(self, address: str, drain_timeout_s: float) -> None:
        from pdserve.v1 import membership_pb2
        self._call("RemoveWorker", membership_pb2.DrainWorkerRequest(address=address, drain_timeout_s=drain_timeout_s),
                   60 + 2 * (drain_timeout_s or DRAIN_TIMEOUT_S))
