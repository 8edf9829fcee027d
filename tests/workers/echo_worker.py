"""A small worker process for the runtime's multi-process tests.

Serves `{namespace}.echo.generate`: yields `n` items `{"i": k}` (optionally `delay` seconds apart)
and, when the request names a `report` file, appends what the handler observed ("stopped",
"killed", "cancelled", "done") to it. Prints READY <instance id hex> once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from tandem.runtime import DistributedRuntime, RuntimeConfig, add_runtime_args, configure_logging, run


def _report(path: str | None, what: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(what + "\n")


async def generate(request: dict, context):  # type: ignore[no-untyped-def]
    report = request.get("report")
    delay = request.get("delay", 0)
    try:
        for k in range(request["n"]):
            if context.is_killed():
                _report(report, "killed")
                return
            if context.is_stopped():
                _report(report, "stopped")
                return
            yield {"i": k, "pad": request.get("pad", "")}
            if delay:
                await asyncio.sleep(delay)
        _report(report, "done")
    except asyncio.CancelledError:
        _report(report, "killed" if context.is_killed() else "cancelled")
        raise


async def main() -> int:
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    parser.add_argument("--component", default="echo")
    args = parser.parse_args()
    configure_logging()
    runtime = await DistributedRuntime.create(RuntimeConfig.from_args(args))
    runtime.install_signal_handlers()
    endpoint = runtime.namespace().component(args.component).endpoint("generate")
    await endpoint.start_serving(generate)
    runtime.set_ready()
    print(f"READY {runtime.instance_id:x}", flush=True)
    await runtime.wait_closed()
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
