"""The ``ddppipe`` command: a table of subcommands."""
