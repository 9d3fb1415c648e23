"""The tensor-parallel failure the command line reports in one line (kept free of torch imports)."""


class FollowerExited(RuntimeError):
    """A tensor-parallel follower exited while the engine needed it; the message names its rank."""
