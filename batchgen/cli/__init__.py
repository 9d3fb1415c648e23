"""The command line: Hydra's app (the only Hydra importer), --help and --version, unknown keys, exit codes."""
