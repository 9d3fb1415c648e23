"""The runners' failures the command line reports in one line (kept free of torch and pyarrow imports)."""


class MergeError(ValueError):
    """The shards cannot be merged: missing or unfinished shards, or rows missing or duplicated."""


class RankFailedError(RuntimeError):
    """A data-parallel child exited with an error."""
