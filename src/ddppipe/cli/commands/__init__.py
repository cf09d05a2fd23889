"""The subcommands' functions: thin adapters from the parsed arguments to each package's
functions, one module per package (named as the package), each named by string in
:data:`ddppipe.cli.subcommands.COMMANDS` and imported only when its command runs."""
