"""`pdserve workers list|add|drain|resume|remove|switch-role`: a running router's membership,
shown (with the cluster token or the admin token) and changed (with the router's admin token)
through its Membership API (services/router/membership.py). The router's address is HOST:PORT,
reached over mutual TLS unless it is on loopback or --insecure-internal-plane is given (as every
member of the internal plane). Importing this module imports no grpc: the handler does."""
from __future__ import annotations

import argparse
import json
import math
import sys

from pdserve.services.cli.usage_errors import RuntimeFailure
from pdserve.services.common.proofs import is_dial_address
from pdserve.services.common.topology import DEFAULT_HOST, DRAIN_TIMEOUT_S, ROUTER_PORT

ACTIONS = ("list", "add", "drain", "resume", "remove", "switch-role")
ROLES = ("prefill", "decode", "both")
CALL_MARGIN_S = 30.0   # a drain's call waits for its timeout, the move of what is left, and this


def add_workers_args(p: argparse.ArgumentParser, add_security_args) -> None:
    p.add_argument("action", choices=ACTIONS, help="list the members; add a worker by address; drain one (no new "
                                                   "requests); resume a drained one; remove one (drains first); "
                                                   "switch-role (drains, then the worker changes role in place)")
    p.add_argument("address", nargs="?", default=None, metavar="WORKER",
                   help="the worker's HOST:PORT (every action but list)")
    p.add_argument("--router", default=f"{DEFAULT_HOST}:{ROUTER_PORT}", metavar="HOST:PORT",
                   help="the router's gRPC address")
    p.add_argument("--role", default=None, choices=ROLES, help="add: the worker's role; switch-role: the new role")
    p.add_argument("--drain-timeout-s", type=float, default=0.0,
                   help="remove, switch-role: in-flight requests get this long to finish, then move to other "
                        "workers (0: the router's --drain-timeout-s; at most an hour)")
    p.add_argument("--json", action="store_true", help="print the members as JSON")
    add_security_args(p, admin=True)
    p.add_argument("--insecure-internal-plane", action="store_true",
                   help="reach a router on another host without mutual TLS (proofs of the tokens and the "
                        "membership travel unencrypted; for trusted networks and tests)")


def run_workers(args: argparse.Namespace) -> int:
    """The command: its credentials (the cluster token, and the admin token: $PDSERVE_ADMIN_TOKEN
    or --admin-token-file), then cmd_workers."""
    from pdserve.services.common.security import Credentials   # lazy: grpc only when this runs
    return cmd_workers(args, Credentials.load(args.cluster_token_file, args.tls_cert, args.tls_key, args.tls_ca,
                                              admin=True, admin_token_file=args.admin_token_file))


def cmd_workers(args: argparse.Namespace, credentials) -> int:
    # lazy: grpc only when this runs
    from pdserve.services.common.security import ADMIN_TOKEN_ENV, MAX_DRAIN_TIMEOUT_S, require_secure_internal_plane
    import grpc

    from pdserve.v1 import membership_pb2 as m
    from pdserve.v1 import membership_pb2_grpc
    from pdserve.v1 import worker_pb2


    if args.action != "list" and not args.address:
        raise ValueError(f"`pdserve workers {args.action}` needs the worker's HOST:PORT")
    for flag, value in (("--router", args.router), ("WORKER", args.address)):
        if value is not None and not is_dial_address(value):
            raise ValueError(f"{flag} must be HOST:PORT (a DNS name, an IPv4 address or a bracketed IPv6 one, no "
                             f"scheme or path; port 1-65535), got {value[:64]!r}")
    if args.action in ("add", "switch-role") and args.role is None:
        raise ValueError(f"`pdserve workers {args.action}` needs --role ({', '.join(ROLES)})")
    if not (math.isfinite(args.drain_timeout_s) and 0 <= args.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S):
        raise ValueError(f"--drain-timeout-s must be in [0, {MAX_DRAIN_TIMEOUT_S:g}], got {args.drain_timeout_s}")
    if args.action != "list" and credentials.admin_token is None:
        raise ValueError(f"`pdserve workers {args.action}` changes the router's membership: it needs the router's "
                         f"admin token: pass --admin-token-file FILE or set ${ADMIN_TOKEN_ENV}")
    require_secure_internal_plane(credentials, "workers command", dials=(args.router,),
                                  insecure_plane=args.insecure_internal_plane)
    role = getattr(worker_pb2, f"WORKER_ROLE_{args.role.upper()}") if args.role else 0
    # remove and switch-role answer once drained: the drain timeout (the router's own is not known
    # here: the default is assumed), the move of what is left, and a margin.
    timeout = CALL_MARGIN_S
    if args.action in ("remove", "switch-role"):
        timeout += 2 * (args.drain_timeout_s or DRAIN_TIMEOUT_S)
    with credentials.sync_channel(args.router) as channel:
        stub = membership_pb2_grpc.MembershipStub(channel)
        calls = {
            "list": lambda: stub.ListWorkers(m.ListWorkersRequest(), timeout=timeout).workers,
            "add": lambda: [stub.AddWorker(m.AddWorkerRequest(address=args.address, role=role), timeout=timeout)],
            "drain": lambda: [stub.DrainWorker(m.DrainWorkerRequest(address=args.address), timeout=timeout)],
            "resume": lambda: [stub.ResumeWorker(m.MemberRequest(address=args.address), timeout=timeout)],
            "remove": lambda: [stub.RemoveWorker(m.DrainWorkerRequest(
                address=args.address, drain_timeout_s=args.drain_timeout_s), timeout=timeout)],
            "switch-role": lambda: [stub.SwitchRole(m.SwitchRoleRequest(
                address=args.address, role=role, drain_timeout_s=args.drain_timeout_s), timeout=timeout)],
        }
        try:
            members = list(calls[args.action]())
        except grpc.RpcError as exc:
            raise RuntimeFailure(_membership_error(args.router, exc)) from None
    rows = [member_row(x) for x in members]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows, sys.stdout)
    return 0


def member_row(member) -> dict:
    from pdserve.v1 import membership_pb2, worker_pb2
    return {"address": member.address,
            "role": worker_pb2.WorkerRole.Name(member.role).removeprefix("WORKER_ROLE_").lower(),
            "state": membership_pb2.MemberState.Name(member.state).removeprefix("MEMBER_STATE_").lower(),
            "worker_id": member.worker_id, "joined": member.joined, "inflight": member.inflight,
            "placed_total": member.placed_total, "free_blocks": member.num_free_blocks,
            "total_blocks": member.num_total_blocks}


def print_table(rows: list[dict], out) -> None:
    columns = ("address", "role", "state", "worker_id", "joined", "inflight", "placed_total", "free_blocks",
               "total_blocks")
    table = [columns] + [tuple(str(r[c]).lower() if isinstance(r[c], bool) else str(r[c]) for c in columns)
                         for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip(), file=out)


def _membership_error(router: str, exc) -> str:
    code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
    if code == "UNAVAILABLE":
        return f"cannot reach the router at {router} (UNAVAILABLE): is it running? pass its address with --router"
    if code == "UNAUTHENTICATED":
        return (f"the router at {router} refused the call (UNAUTHENTICATED: {(exc.details() or '')[:200]}): listing "
                f"needs the deployment's cluster token (--cluster-token-file FILE or $PDSERVE_CLUSTER_TOKEN) or the "
                f"router's admin token, and every change the admin token (--admin-token-file FILE or "
                f"$PDSERVE_ADMIN_TOKEN)")
    if code == "DEADLINE_EXCEEDED":
        return (f"the router at {router} did not answer in time: the worker may still be draining (see `pdserve "
                f"workers list`); pass a shorter --drain-timeout-s to move its requests sooner")
    return f"the router at {router} answered {code}: {exc.details()}"
