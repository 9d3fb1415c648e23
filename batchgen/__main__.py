"""The command line's one entry point: `python -m batchgen` and the `batchgen` console script both run main()."""

import sys

from batchgen.cli.usage import early_exit


def main() -> None:
    """--help and --version are answered before Hydra, torch or a model is imported; anything else is a job."""
    text = early_exit(sys.argv[1:])
    if text is not None:
        print(text)
        return
    from batchgen.cli.main import main as run_job

    run_job()


if __name__ == "__main__":
    main()
