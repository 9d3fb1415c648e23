"""The command line's one entry point: `python -m batchgen` and the `batchgen` console script both run main()."""

import sys

from batchgen.job import process_clock  # first of batchgen's own: the process's start-up is counted from here


def main() -> None:
    """--help and --version are answered before Hydra, torch or a model is imported; anything else is a job."""
    from batchgen.cli.usage import early_exit

    text = early_exit(sys.argv[1:])
    if text is not None:
        print(text)
        return
    process_clock.start()
    from batchgen.cli.main import main as run_job

    process_clock.mark("cli_imports")
    run_job()
    # The jobs finished: their files are final. A job that fails exits by SystemExit, the ordinary way, unless a
    # tensor-parallel follower died (batchgen.cli.main).
    from batchgen.job.exits import end_process

    end_process()


if __name__ == "__main__":
    main()
