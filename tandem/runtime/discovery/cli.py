"""`tandem discovery ls [PREFIX]`: what is registered (instances, model cards, event channels)."""

from __future__ import annotations

import argparse
import asyncio
import json

from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery import make_store
from tandem.runtime.options import add_runtime_args


async def _list(config: RuntimeConfig, prefix: str, as_json: bool) -> int:
    store = make_store(config.discovery_backend, file_root=config.file_kv_root, ttl=config.discovery_ttl)
    await store.start()
    try:
        entries = await store.get_prefix(prefix)
    finally:
        await store.close()
    if as_json:
        print(json.dumps({k: _decode(v) for k, v in sorted(entries.items())}, indent=2))
    else:
        for key in sorted(entries):
            print(f"{key}  {entries[key].decode(errors='replace')}")
    return 0


def _decode(value: bytes) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return value.decode(errors="replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem discovery", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list keys under a prefix")
    ls.add_argument("prefix", nargs="?", default="v1/", help="key prefix (default v1/)")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    add_runtime_args(ls)
    args = parser.parse_args(argv)
    config = RuntimeConfig.from_args(args)
    return asyncio.run(_list(config, args.prefix, args.json))
