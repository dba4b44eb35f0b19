"""One module per ``ppc`` subcommand, each with ``main(argv) -> int``."""
