"""The parts every ``megarl`` command shares: the registry of subcommands (:func:`command`), the argparse
types whose errors name their flag, the split of ``[CONFIG.yaml] [key=value ...]`` and the help texts of the
flags that several commands take."""

from __future__ import annotations

import argparse
from typing import Callable


class UsageError(ValueError):
    """Bad command-line input; the message names the flag and the fix."""


class Interrupted(Exception):
    """The user stopped the command (Ctrl-C, or a SIGTERM to its launcher); the message says how to go on."""


class _Parser(argparse.ArgumentParser):
    """argparse with errors as one ``megarl: error:`` line (no usage dump), raised so :func:`main` prints it."""

    def error(self, message: str):  # noqa: D102 (argparse API)
        where = self.prog.removeprefix("megarl").strip()
        raise UsageError(f"{where + ': ' if where else ''}{message} (see {self.prog} --help)")


def int_at_least(flag: str, low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= ``low`` whose error names ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {low}, got {value}")
        return value
    return parse


def positive_int(flag: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer >= 1 whose error names ``flag``."""
    return int_at_least(flag, 1)


def positive_float(flag: str, minimum: float | None = None) -> Callable[[str], float]:
    """An argparse ``type`` for a finite number > 0 (>= ``minimum`` when given) whose error names ``flag``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number > 0, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number > 0, got {text}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum:g}, got {text}")
        return value
    return parse


_COMMANDS: list[tuple[tuple[str, ...], str, Callable]] = []


def command(*path: str, help: str):
    """Register ``fn(parser)`` as the builder of subcommand ``path`` (e.g. ``("bench", "reshard")``); the
    builder adds the arguments and returns the function ``run(args) -> int`` that executes the command."""
    def register(fn: Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]):
        _COMMANDS.append((path, help, fn))
        return fn
    return register


def split_config_and_overrides(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """``megarl CMD [CONFIG.yaml] [key=value ...]``: a first positional with ``=`` is an override."""
    if config and "=" in config:
        return None, [config, *overrides]
    return config, list(overrides)

OVERWRITE_HELP = ("replace what an earlier run of this command wrote into the folder, or write into a folder that "
                  "holds other files, which stay as they are (a file of a name the command writes is refused, never "
                  "replaced; a training run's folder or checkpoint is refused always). Default: only a new or empty "
                  "folder")
FILE_OVERWRITE_HELP = ("replace the output files when they exist (an earlier run's, or anyone's), each written beside "
                       "and renamed into place. Default: refuse")
CHECK_HELP = ("check the config against its model, tokenizer, files and reward function (every check made "
              "before a run, less what this machine lacks, e.g. a GPU), print the result and run nothing")

