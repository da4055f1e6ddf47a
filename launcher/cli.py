"""The ``fleetrl`` command line: runs demos on this machine and recipes on Ray (``up``, ``down``, ``scale``),
starts roles as processes, initialises models, and operates a running coordinator through its admin API
(``admin_cli``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from launcher.admin_cli import add_admin_commands, run_admin_command

ADMIN_COMMANDS = ("status", "pause", "resume", "drain", "set", "sync", "servers")
DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo-echo.yaml"


def _cmd_demo(args: argparse.Namespace) -> int:
    from launcher.demo import RoleFailed, run_demo
    from protos.config import describe_config_error, load_run_config

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"num_steps={args.steps}")
    try:
        # The guide's run variables (MAX_TRAINING_STEPS, CKPT_PATH, ...) come from the environment here, where a run
        # starts from a recipe; the roles read the resolved config.json, which already holds them.
        config = load_run_config(args.config or [str(DEFAULT_RECIPE)], overrides, environ=os.environ)
    except ValueError as error:
        print(f"fleetrl demo: invalid config: {describe_config_error(error)}", file=sys.stderr)
        return 2
    out_dir = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    _stop_on_signals()
    try:
        summary = run_demo(config, out_dir)
    except RoleFailed as error:
        print(f"fleetrl demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fleetrl demo: interrupted; every process was stopped", file=sys.stderr)
        return 130
    shown = {k: v for k, v in summary.items() if k != "rewards"}
    print(json.dumps(shown, indent=2))
    print(f"summary written to {out_dir / 'summary.json'}")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from launcher.ray_launcher import RunStopped, run_up
    from launcher.supervision import RoleFailed
    from protos.config import describe_config_error, load_run_config

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"num_steps={args.steps}")
    if args.ray is not None:
        overrides.append(f"launcher.ray.address={args.ray}")
    try:
        config = load_run_config([args.recipe, *(args.config or [])], overrides)
    except ValueError as error:
        print(f"fleetrl up: invalid config: {describe_config_error(error)}", file=sys.stderr)
        return 2
    out_dir = Path(args.out or f"runs/up-{config.run_id}-{time.strftime('%Y%m%d-%H%M%S')}")
    _stop_on_signals()
    try:
        summary = run_up(config, out_dir)
    except RoleFailed as error:
        print(f"fleetrl up: {error}", file=sys.stderr)
        return 1
    except RunStopped as stopped:
        print(f"fleetrl up: {stopped}: every role was stopped", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        print("fleetrl up: interrupted; every role was stopped", file=sys.stderr)
        return 130
    shown = {k: v for k, v in summary.items() if k != "rewards"}
    print(json.dumps(shown, indent=2))
    print(f"summary written to {out_dir / 'summary.json'}")
    return 0


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # what kill, systemd, Kubernetes, Ray and a closed terminal send


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP stop a run as Ctrl-C does: every role process (engines and ranks with their process
    groups), every actor and the embedded Redis, on the launcher's way out."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)


def _interrupt(signum, frame) -> None:
    for sig in STOP_SIGNALS:  # the stop that follows runs to its end; a second Ctrl-C still cuts it short
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _run_location(args: argparse.Namespace, verb: str):
    from launcher.ray_control import RunLocation, read_state

    if args.run_dir:
        return read_state(Path(args.run_dir))
    if args.run_id and args.ray:
        return RunLocation(args.ray, args.namespace, args.run_id)
    raise ValueError(f"fleetrl {verb}: name the run: --run-dir DIR (of `fleetrl up`), or --ray ADDRESS --run-id ID")


def _cmd_down(args: argparse.Namespace) -> int:
    from launcher.ray_control import RunNotFound, request_down

    try:
        location = _run_location(args, "down")
        stopped = request_down(location, args.wait_s)
    except (RunNotFound, ValueError) as error:
        print(f"fleetrl down: {error}", file=sys.stderr)
        return 2
    if not stopped:
        print(f"fleetrl down: run {location.run_id} asked to stop; still stopping after {args.wait_s:.0f}s")
        return 1
    print(f"run {location.run_id} stopped")
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    from launcher.ray_control import RunNotFound, request_scale, serving_replicas

    role, sep, raw = args.assignment.partition("=")
    try:
        if not sep or not raw.strip().isdigit():
            raise ValueError(f"fleetrl scale: expected ROLE=COUNT (e.g. rollout=3), got {args.assignment!r}")
        location = _run_location(args, "scale")
        report = request_scale(location, role.strip(), int(raw), args.wait_s)
    except (RunNotFound, ValueError) as error:
        print(f"fleetrl scale: {error}", file=sys.stderr)
        return 2
    serving = serving_replicas(report, role.strip())
    if serving != int(raw):
        print(f"fleetrl scale: asked for {role}={raw}; {max(serving, 0)} serving after {args.wait_s:.0f}s")
        return 1
    print(f"run {location.run_id}: {serving} {role} replicas serving")
    return 0


def _add_up_commands(commands) -> None:
    up = commands.add_parser("up", help="run a recipe on a Ray cluster: each role a process owned by a Ray actor")
    up.add_argument("recipe", help="YAML/JSON run config, e.g. recipes/demo-echo.yaml")
    up.add_argument("--ray", default=None, help="'local' (start a cluster here) or 'auto'/HOST:PORT (join one)")
    up.add_argument("--steps", type=int, default=None, help="training steps (default: num_steps)")
    up.add_argument("--out", default=None, help="run directory (default runs/up-<run_id>-<time>)")
    up.add_argument("--config", action="append", default=None, help="more config files merged after the recipe")
    up.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_servers=4")
    up.set_defaults(func=_cmd_up)
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--run-dir", default=None, help="the run directory of `fleetrl up` (holds ray_run.json)")
    where.add_argument("--ray", default=None, help="the run's Ray cluster (with --run-id instead of --run-dir)")
    where.add_argument("--run-id", default=None, help="the run's run_id (with --ray)")
    where.add_argument("--namespace", default="fleetrl", help="Ray namespace of the run (launcher.ray.namespace)")
    down = commands.add_parser("down", parents=[where], help="stop a run started by `fleetrl up`")
    down.add_argument("--wait-s", type=float, default=120.0, help="wait this long for every role to stop")
    down.set_defaults(func=_cmd_down)
    scale = commands.add_parser("scale", parents=[where], help="change the replicas of a live `fleetrl up` run")
    scale.add_argument("assignment", metavar="ROLE=COUNT", help="e.g. rollout=3 (only rollout scales)")
    scale.add_argument("--wait-s", type=float, default=600.0, help="wait this long for the replicas to serve")
    scale.set_defaults(func=_cmd_scale)


def _cmd_rollout(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "rollout_service", *args.rest]  # rest starts with "serve" (main checked)
    os.execv(sys.executable, argv)
    return 0  # not reached


def _cmd_model_init_tiny(args: argparse.Namespace) -> int:
    if args.tokenizer == "bpe":
        return _init_tiny_with_bpe(args)
    if args.family == "beam":
        from modeling.beam.tiny import init_tiny_beam as init_tiny
    else:
        from modeling.tiny_model import init_tiny
    path = init_tiny(args.path, seed=args.seed, warmup_steps=args.warmup_steps)
    print(f"tiny MoE checkpoint and tokenizer written to {path}")
    return 0


def _init_tiny_with_bpe(args: argparse.Namespace) -> int:
    # The echo warm-up fits the character vocabulary's digit ids; the BPE checkpoint stays random.
    if args.family != "qwen3-moe" or args.warmup_steps:
        print(
            "fleetrl model init-tiny: --tokenizer bpe builds only --family qwen3-moe, without --warmup-steps",
            file=sys.stderr,
        )
        return 2
    from modeling.user_checkpoint import init_user_checkpoint

    path = init_user_checkpoint(args.path, family="qwen3_moe", seed=args.seed)
    print(f"tiny MoE checkpoint with the BPE tokenizer and its chat template written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetrl", description="Asynchronous disaggregated RL for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the whole loop on this machine (CPU, tiny model, embedded Redis)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: num_steps)")
    demo.add_argument("--out", default=None, help="run directory (default runs/demo-<time>)")
    demo.add_argument(
        "--config",
        action="append",
        default=None,
        help="YAML/JSON run config (default recipes/demo-echo.yaml); several are merged in order",
    )
    demo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-3")
    demo.set_defaults(func=_cmd_demo)

    rollout = commands.add_parser("rollout", help="rollout server commands")
    rollout.add_argument("rest", nargs=argparse.REMAINDER, help="serve --model PATH --host H --port P ...")
    rollout.set_defaults(func=_cmd_rollout)

    model = commands.add_parser("model", help="model utilities")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    init_tiny = model_commands.add_parser("init-tiny", help="write the tiny local MoE checkpoint + tokenizer")
    init_tiny.add_argument("path")
    init_tiny.add_argument("--seed", type=int, default=0)
    init_tiny.add_argument("--warmup-steps", type=int, default=0, help="short echo warm-up (the demo uses 150)")
    init_tiny.add_argument("--family", choices=["qwen3-moe", "beam"], default="qwen3-moe", help="model architecture")
    init_tiny.add_argument(
        "--tokenizer",
        choices=["char", "bpe"],
        default="char",
        help="char: the 64-character vocabulary; bpe: a byte-level BPE with a ChatML template, as a user's checkpoint",
    )
    init_tiny.set_defaults(func=_cmd_model_init_tiny)

    _add_up_commands(commands)
    add_admin_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Dotted overrides may follow options (`fleetrl up RECIPE --ray local num_steps=3`), which argparse leaves over.
    if extra and (not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command == "rollout" and (not args.rest or args.rest[0] != "serve"):
        print("fleetrl rollout: usage: fleetrl rollout serve --model PATH [--host H] [--port P] ...", file=sys.stderr)
        sys.exit(2)
    if args.command in ADMIN_COMMANDS:
        sys.exit(run_admin_command(args))
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
