"""The `cotangent` command's subcommands, one module each: its parser (`add_parser(sub)`) and
its body (`run(args)`, returning the exit status). `cotangent.harness.cli.main` dispatches."""
