"""Usage errors: what every command line of forerun (generate, models, bench, serve, train-eagle, the
`python -m` tools) raises for input it cannot run, so that `forerun.cli.main` prints it as one line
("forerun: error: ...", exit code 2) with no traceback. It sits below everything (it imports only argparse):
a loader or a tool can raise it without importing the CLI."""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """A command line that cannot run as given (exit code 2, no traceback)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error ("forerun: error: ...; see `PROG --help`") and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def run(main, argv=None) -> int:
    """A `python -m` entry point's exit code: ``main(argv)``, with a UsageError printed as one line (exit 2)."""
    import sys

    try:
        return main(argv)
    except UsageError as e:
        print(f"forerun: error: {e}", file=sys.stderr)
        return 2
