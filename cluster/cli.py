"""``dspark``: the command line.

Subcommands import what they need when they run, so ``dspark --help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from configs import ConfigError, load


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark",
        description="DSpark speculative decoding on Ray: check configs, generate text.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check-config",
        help="validate a YAML/JSON engine config and print it resolved (drafter fields read from the checkpoint)",
        description="Validate an engine config file (fields of configs.LLMConfig, with a nested "
        "speculative_config of DSparkDecodingConfig fields). Fields left unset that the drafter checkpoint "
        "knows are filled from its config.json; the result is printed as JSON. Exit status 2 on an "
        "invalid config, with one line per bad field.",
    )
    check.add_argument("config", help="path to a .yaml, .yml or .json file")
    check.set_defaults(handler=run_check_config)
    return parser


def run_check_config(args: argparse.Namespace) -> int:
    config = load(args.config)
    resolved = config.model_dump(mode="json")
    spec = config.speculative_config
    if spec is not None:
        resolved["speculative_config"]["draft_is_embedded_in_target"] = spec.draft_is_embedded_in_target
    print(json.dumps(resolved, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"dspark: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
