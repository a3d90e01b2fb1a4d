"""`python -m skyrl_tx.api --base-model M ...`: the same as `skyrl-tx serve`."""

from __future__ import annotations

import argparse
import sys

from skyrl_tx.cli import add_serve_arguments, run, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyrl_tx.api", description="Serve the Tinker API.")
    add_serve_arguments(parser)
    parser.set_defaults(func=serve)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
