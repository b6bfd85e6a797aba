"""`python -m vitkit` and the `vitkit` command. The command's modules (torch with them) load inside `run`, so a
Ctrl-C while they load ends it with one line, as one later does."""

import sys


def run() -> int:
    try:
        from .cli import main

        return main()
    except KeyboardInterrupt:  # before a command began (a command's own are answered in `main`)
        print("vitkit: stopped (Ctrl-C) while starting; nothing was done", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(run())
