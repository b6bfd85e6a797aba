"""The `vitkit` command line: the parser and what each command does."""
