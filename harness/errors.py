"""One exception type for everything a user can get wrong.

The CLI prints ``HarnessError`` as a single line and exits non-zero; anything
else is a bug and keeps its traceback.
"""

import sys

#: exit statuses of every command: a user's mistake (one line on stderr), a failed run or gate
EXIT_USAGE = 2
EXIT_FAIL = 1


class HarnessError(Exception):
    """A user-facing error: bad config, bad input, a refused candidate, a dead rank."""


class ConfigError(HarnessError):
    """The configuration (preset, TOML, command line) is invalid."""


class RunFailed(HarnessError):
    """The run itself failed (a dead rank, a full disk): exit status 1, not a usage error."""


def report(e: HarnessError) -> int:
    """A command's error path: one ``error:`` line on stderr (the message's first line), and the exit
    status — 1 when the run itself failed, 2 for a user's mistake."""
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(f"error: {msg}", file=sys.stderr)
    return EXIT_FAIL if isinstance(e, RunFailed) else EXIT_USAGE
