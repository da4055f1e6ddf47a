"""``fleetrl status|pause|resume|drain|set|sync|servers``: the CLI of the coordinator's admin API.

The CLI finds the coordinator at ``--admin HOST:PORT``, else ``$FLEETRL_ADMIN``, else
``127.0.0.1:50050`` (the default ``coordinator.admin_port``). A coordinator with a token file wants
``--token`` (default ``$FLEETRL_TOKEN``) of scope ``admin``; one that speaks TLS wants ``--tls-ca FILE``.
Exit codes: 0 done; 1 the operation did not complete in time (drain, sync); 2 the coordinator refused
the request (unknown key, bad value, not allowed now, no or wrong token); 3 the coordinator is unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

DEFAULT_ADMIN = "127.0.0.1:50050"
EXIT_INCOMPLETE, EXIT_REFUSED, EXIT_UNREACHABLE = 1, 2, 3


class AdminCallFailed(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# What to do about a refused token, by code.
_AUTH_HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "pass --token TOKEN or set FLEETRL_TOKEN",
    grpc.StatusCode.PERMISSION_DENIED: "the admin verbs need a token of scope admin",
}


def _channel(args: argparse.Namespace) -> grpc.Channel:
    from launcher.auth_client import channel_credentials

    if args.tls_ca:
        try:
            return grpc.secure_channel(args.admin, channel_credentials(args.tls_ca))
        except OSError as error:
            raise AdminCallFailed(f"--tls-ca {args.tls_ca}: cannot read it ({error.strerror})", EXIT_REFUSED) from None
    return grpc.insecure_channel(args.admin)


def _call(args: argparse.Namespace, method: str, request, timeout_s: float | None = None):
    from launcher.auth_client import call_metadata
    from protos import admin_pb2_grpc as pb_grpc

    with _channel(args) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=min(args.timeout_s, 5.0))
        except grpc.FutureTimeoutError:
            tls = "" if args.tls_ca else " (if it speaks TLS, pass --tls-ca FILE)"
            raise AdminCallFailed(
                f"cannot reach the coordinator admin API at {args.admin}; is the coordinator running? "
                f"Pass --admin HOST:PORT or set FLEETRL_ADMIN{tls}",
                EXIT_UNREACHABLE,
            ) from None
        stub = pb_grpc.CoordinatorAdminStub(channel)
        try:
            return getattr(stub, method)(
                request, timeout=timeout_s or args.timeout_s, metadata=call_metadata(args.token)
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise AdminCallFailed(
                    f"the coordinator admin API at {args.admin} went away: {error.details()}", EXIT_UNREACHABLE
                ) from None
            if error.code() in _AUTH_HINTS:
                raise AdminCallFailed(
                    f"{error.details()} ({error.code().name}); {_AUTH_HINTS[error.code()]}", EXIT_REFUSED
                ) from None
            raise AdminCallFailed(f"{error.details()} ({error.code().name})", EXIT_REFUSED) from None


def _state_name(state: int) -> str:
    from protos import admin_pb2 as pb

    return pb.RunState.Name(state).removeprefix("RUN_STATE_").lower()


def _cmd_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from protos import admin_pb2 as pb

    reply = _call(args, "GetStatus", pb.GetStatusRequest())
    if args.json:
        print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
        return 0
    print(format_status(reply))
    return 0


def format_status(r) -> str:
    """The status as a few summary lines and a table of servers."""
    lines = [
        f"run {r.run_id} | {_state_name(r.state)} | task {r.task} | up {r.uptime_s:.0f}s",
        f"trainer  v{r.trainer_policy_version} (started at v{r.start_policy_version}) | max_staleness {r.max_staleness}"
        f" | max staleness at push {r.max_staleness_at_push} | B {r.groups_per_step} groups x n {r.group_size}",
        f"groups   slots {r.slots_admitted}/{r.admission_limit} admissible (run: {r.total_groups}) | admitted "
        f"{r.groups_admitted} | pushed {r.groups_pushed} | in flight {r.groups_in_flight} | skipped {r.groups_skipped}"
        f" | redispatches {r.redispatches}",
        f"queue    depth {r.queue_depth} | {r.tokens_per_s:.0f} tok/s | {r.groups_per_s:.2f} groups/s",
    ]
    if r.eval_version >= 0 or r.next_eval_version >= 0:
        shown = " ".join(f"{k}={v:.3f}" for k, v in sorted(r.eval.items()) if not k.endswith("_s"))
        lines.append(f"eval     last v{r.eval_version} {shown} | next v{r.next_eval_version}")
    rows = [("SERVER", "ID", "HEALTHY", "VERSION", "INFLIGHT", "REQUESTS", "FAILURES")]
    rows += [
        (
            s.address,
            s.server_id,
            "yes" if s.healthy else "NO",
            str(s.policy_version),
            str(s.inflight),
            str(s.requests),
            str(s.failures),
        )
        for s in r.servers
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)


def _cmd_pause(args: argparse.Namespace) -> int:
    from protos import admin_pb2 as pb

    reply = _call(args, "Pause", pb.PauseRequest())
    print(f"coordinator {_state_name(reply.state)}: admitting no new groups; in-flight groups finish")
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from protos import admin_pb2 as pb

    reply = _call(args, "Resume", pb.ResumeRequest())
    print(f"coordinator {_state_name(reply.state)}")
    return 0


def _cmd_drain(args: argparse.Namespace) -> int:
    from protos import admin_pb2 as pb

    reply = _call(args, "Drain", pb.DrainRequest(wait_s=args.wait_s), timeout_s=args.wait_s + args.timeout_s)
    state = _state_name(reply.state)
    print(f"coordinator {state}: {reply.groups_in_flight} groups in flight, {reply.groups_pushed} pushed")
    return 0 if reply.state == pb.RUN_STATE_DRAINED or args.wait_s == 0 else EXIT_INCOMPLETE


def _cmd_set(args: argparse.Namespace) -> int:
    from protos import admin_pb2 as pb

    key, sep, value = args.assignment.partition("=")
    if not sep or not key.strip():
        raise AdminCallFailed(f"expected KEY=VALUE (e.g. max_staleness=2), got {args.assignment!r}", EXIT_REFUSED)
    reply = _call(args, "SetConfig", pb.SetConfigRequest(key=key.strip(), value=value.strip()))
    told = f" (trainer told: control entry {reply.control_entry_id})" if reply.control_entry_id else ""
    print(f"{reply.key}: {reply.old_value} -> {reply.new_value}{told}")
    return 0


def _cmd_sync(args: argparse.Namespace) -> int:
    from protos import admin_pb2 as pb

    reply = _call(args, "Sync", pb.SyncRequest(wait_s=args.wait_s), timeout_s=args.wait_s + args.timeout_s)
    if reply.published:
        print(f"trainer published policy version {reply.policy_version} (sync request {reply.control_entry_id})")
        return 0
    print(
        f"sync requested (control entry {reply.control_entry_id}); no weight publish seen within {args.wait_s:.0f}s "
        "(the trainer acts on it between steps)",
        file=sys.stderr,
    )
    return 0 if args.wait_s == 0 else EXIT_INCOMPLETE


def _cmd_servers(args: argparse.Namespace) -> int:
    from protos import admin_pb2 as pb

    if args.action == "add":
        reply = _call(args, "AddServer", pb.AddServerRequest(address=args.address))
        print(f"added {args.address} ({reply.server_id}, v{reply.policy_version}); {reply.num_servers} servers")
    else:
        reply = _call(args, "RemoveServer", pb.RemoveServerRequest(address=args.address))
        print(f"removed {args.address} ({reply.inflight} calls still finishing there); {reply.num_servers} servers")
    return 0


def add_admin_commands(commands) -> None:
    """Register the admin subcommands on the ``fleetrl`` parser's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--admin",
        default=os.environ.get("FLEETRL_ADMIN", DEFAULT_ADMIN),
        help=f"coordinator admin API HOST:PORT (default $FLEETRL_ADMIN or {DEFAULT_ADMIN})",
    )
    common.add_argument("--timeout-s", type=float, default=10.0, help="deadline of one admin call")
    common.add_argument(
        "--token",
        default=os.environ.get("FLEETRL_TOKEN", ""),
        help="bearer token of scope admin (default $FLEETRL_TOKEN; prefer the variable: argv is visible to others)",
    )
    common.add_argument("--tls-ca", default="", metavar="FILE", help="PEM CA (or server) certificate: connect by TLS")
    status = commands.add_parser("status", parents=[common], help="fleet, versions, queue, staleness, throughput")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    status.set_defaults(func=_cmd_status)
    commands.add_parser("pause", parents=[common], help="admit no new groups").set_defaults(func=_cmd_pause)
    commands.add_parser("resume", parents=[common], help="admit groups again").set_defaults(func=_cmd_resume)
    drain = commands.add_parser("drain", parents=[common], help="finish in-flight work, admit nothing, then stop")
    drain.add_argument("--wait-s", type=float, default=60.0, help="wait this long for the drain (0 = don't wait)")
    drain.set_defaults(func=_cmd_drain)
    setter = commands.add_parser("set", parents=[common], help="change a run-time setting, e.g. max_staleness=2")
    setter.add_argument("assignment", metavar="KEY=VALUE")
    setter.set_defaults(func=_cmd_set)
    sync = commands.add_parser("sync", parents=[common], help="ask the trainer to publish its weights now")
    sync.add_argument("--wait-s", type=float, default=30.0, help="wait this long for the publish (0 = don't wait)")
    sync.set_defaults(func=_cmd_sync)
    servers = commands.add_parser("servers", parents=[common], help="add or remove a rollout server")
    servers.add_argument("action", choices=["add", "remove"])
    servers.add_argument("address", metavar="HOST:PORT")
    servers.set_defaults(func=_cmd_servers)


def run_admin_command(args: argparse.Namespace) -> int:
    """Run one admin subcommand; errors print one clear line to stderr and give a non-zero code."""
    try:
        return args.func(args)
    except AdminCallFailed as error:
        print(f"fleetrl {args.command}: {error}", file=sys.stderr)
        return error.exit_code
