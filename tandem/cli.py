"""The `tandem` console script: one subcommand per component, each also runnable as `python -m`."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv)`, one-line help). Imported lazily so `tandem --help` stays fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "frontend": ("tandem.frontend.main", "the OpenAI-compatible HTTP frontend"),
    "model": ("tandem.models.cli", "prepare and locate models (`tandem model prepare`)"),
    "vllm": ("tandem.vllm.main", "a vLLM worker (`tandem vllm --model smollm2`)"),
    "mocker": ("tandem.mocker.main", "simulated vLLM workers for scale tests and benchmarks"),
    "router": ("tandem.router.main", "the KV router as a standalone service"),
    "discovery": ("tandem.runtime.discovery.cli", "list what is registered in discovery"),
    "run": ("tandem.launch.main", "a whole deployment on this machine (`tandem run --workers 2`)"),
    "planner": ("tandem.planner.main", "the SLA planner beside a deployment, observing (`--no-operation`)"),
    "profile": ("tandem.launch.profile", "measure a worker's prefill and decode performance for the planner"),
}


def _usage() -> str:
    lines = ["usage: tandem <command> [args...]", "", "commands:"]
    width = max(len(name) for name in SUBCOMMANDS)
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += [f"  {'version':<{width}}  print the tandem version", "",
              "Run `tandem <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    if command in ("version", "--version"):
        from tandem import __version__

        print(f"tandem {__version__}")
        return 0
    if command not in SUBCOMMANDS:
        print(f"tandem: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
