"""`python -m vitkit` and the `vitkit` command. The command's modules (torch with them) load inside `run`, so a
Ctrl-C while they load ends it with one line, as one later does."""

import sys


def run() -> int:
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("vitkit: stopped (Ctrl-C) while starting; nothing was done", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    raise SystemExit(run())
