"""The command line's one entry point: `python -m batchgen` and the `batchgen` console script both run main()."""

import atexit
import os
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
    end_process()


def end_process() -> None:
    """Ends a process whose jobs finished: their files are final, so the exit handlers (the log's flush among them)
    run, and then the process ends without the interpreter's teardown, which only frees objects (every module's,
    libtorch's, the CUDA context) and on a GPU machine costs a short job a noticeable share of its time
    (benchmarks/RESULTS.md). A job that fails exits the ordinary way, by SystemExit."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
