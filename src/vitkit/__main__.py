"""`python -m vitkit` and the `vitkit` command. The command's modules (torch with them) load inside `run`, so a
Ctrl-C while they load ends it with one line, as one later does."""

import sys


def run() -> int:
    try:
        from .cli import main

        return main()
    except (KeyboardInterrupt, RuntimeError) as e:  # before a command began (a command's own are answered in `main`)
        if isinstance(e, RuntimeError) and not isinstance(e.__cause__, KeyboardInterrupt):
            raise  # a Ctrl-C arrives wrapped in a RuntimeError where it hit an import in a class body (`cli.main`)
        print("vitkit: stopped (Ctrl-C) while starting; nothing was done", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(run())
