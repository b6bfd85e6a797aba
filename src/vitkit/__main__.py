"""`python -m vitkit` and the `vitkit` command. The command's modules (torch with them) load inside `run`, so a
Ctrl-C while they load ends it with one line, as one later does."""

import sys

from vitkit.errors import is_ctrl_c  # the standard library only: loads at once


def run() -> int:
    try:
        from vitkit.cli.parser import main

        return main()
    except (KeyboardInterrupt, RuntimeError) as e:  # before a command began (a command's own are answered in `main`)
        if not is_ctrl_c(e):
            raise
        print("vitkit: stopped (Ctrl-C) while starting; nothing was done", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(run())
