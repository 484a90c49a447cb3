"""The one error type for bad input, and how every command line turns errors into exit codes."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


class UsageError(Exception):
    """Bad input from the user: the CLI prints the one-line message and exits 2, no traceback."""


class Parser(argparse.ArgumentParser):
    """argparse with the commands' contract for bad input: one `error:` line that names --help, exit 2 (argparse
    prints the whole usage first: 43 lines for the main command)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def cli_exit(work: Callable[[], object]) -> int:
    """Run a command's work: 0 on success, 2 with one `error:` line for bad input or an unusable file,
    130 when interrupted. Anything else is a bug and keeps its traceback."""
    try:
        work()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
