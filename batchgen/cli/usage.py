"""`--help` and `--version`: batchgen's own, answered before Hydra, torch or a model is imported."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, metadata
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
HELP_FLAGS = ("--help", "-h")
VERSION_FLAG = "--version"


def _package() -> tuple[str, str]:
    """(version, one-line description) from the installed package's metadata."""
    try:
        found = metadata("batchgen")
    except PackageNotFoundError:
        return "unknown (not installed)", "Offline batch generation for Hugging Face causal language models."
    return found["Version"], found["Summary"]


def version_text() -> str:
    return f"batchgen {_package()[0]}"


def config_groups(conf_dir: Path = CONF_DIR) -> dict[str, list[str]]:
    """Each config group (a folder of conf/) and its options."""
    return {group.name: sorted(option.stem for option in group.glob("*.yaml"))
            for group in sorted(conf_dir.iterdir()) if group.is_dir()}


def help_text() -> str:
    version, description = _package()
    groups = "\n".join(f"  {group:<8} {', '.join(options)}" for group, options in config_groups().items())
    return f"""batchgen {version}: {description}

Usage:
  python -m batchgen job=shakespeare                       the main job
  python -m batchgen model.path=DIR data.path=FILE [group=option ...] [key=value ...]
  python -m batchgen -m job=shakespeare key=a,b            a sweep: one run per value
  python -m batchgen ... hydra.run.dir=RUN job.resume=true continue a stopped run

Config groups (group=option):
{groups}

Keys: job.*, model.*, engine.*, data.*, sampling.* (see README.md). `--cfg job` prints the composed
configuration; `--hydra-help` shows Hydra's own options.
Exit codes: 0 done, 1 crash, 2 invalid configuration or input, 130 / 143 stopped by SIGINT / SIGTERM."""


def early_exit(args: list[str]) -> str | None:
    """The text to print for --help / --version, None for a job's command line."""
    if any(arg in HELP_FLAGS for arg in args):
        return help_text()
    if VERSION_FLAG in args:
        return version_text()
    return None
