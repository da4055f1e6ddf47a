"""The ``fleetrl`` command line: runs demos, starts roles as processes, initialises models, and operates a
running coordinator through its admin API (``admin_cli``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from coordinator.admin_cli import add_admin_commands, run_admin_command

ADMIN_COMMANDS = ("status", "pause", "resume", "drain", "set", "sync", "servers")
DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "demo-echo.yaml"


def _cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.launcher import RoleFailed, run_demo
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


def _cmd_rollout(args: argparse.Namespace) -> int:
    argv = [sys.executable, "-m", "rollout_service", *args.rest]  # rest starts with "serve" (main checked)
    os.execv(sys.executable, argv)
    return 0  # not reached


def _cmd_model_init_tiny(args: argparse.Namespace) -> int:
    if args.family == "beam":
        from modeling.beam.tiny import init_tiny_beam as init_tiny
    else:
        from modeling.tiny_model import init_tiny
    path = init_tiny(args.path, seed=args.seed, warmup_steps=args.warmup_steps)
    print(f"tiny MoE checkpoint and tokenizer written to {path}")
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
    init_tiny.set_defaults(func=_cmd_model_init_tiny)

    add_admin_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "rollout" and (not args.rest or args.rest[0] != "serve"):
        print("fleetrl rollout: usage: fleetrl rollout serve --model PATH [--host H] [--port P] ...", file=sys.stderr)
        sys.exit(2)
    if args.command in ADMIN_COMMANDS:
        sys.exit(run_admin_command(args))
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
