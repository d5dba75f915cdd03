"""The command line and process launching: the `fedmed` command, its subcommands, and the Flower processes it starts."""
