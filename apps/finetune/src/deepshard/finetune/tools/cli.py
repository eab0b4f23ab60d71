"""The argument parser of the tools' command lines: a bad argument is one line and exit 2."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose error is ``PROG: error: MESSAGE (see PROG --help)``, one line, exit 2,
    as every other refusal of ours is one line (argparse's own prints the usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
