"""Run labels: the settings that differ between the runs of a set, not their folder numbers."""

from __future__ import annotations

from batchgen.report.run_data import Run

# Settings that differ between any two runs without describing the experiment.
IGNORED_KEYS = {"job.resume", "hydra.run.dir", "hydra.sweep.dir", "hydra.job.chdir"}


def differing_keys(runs: list[Run]) -> list[str]:
    """Keys overridden in some run, or set in some config, whose values are not the same in every run."""
    overridden = {key for run in runs for key in run.overrides}
    configured = {key for run in runs for key in run.config}
    keys = [key for key in sorted(overridden) if key not in IGNORED_KEYS]
    if not overridden:
        keys = sorted(configured - IGNORED_KEYS)
    return [key for key in keys if len({run.value(key) for run in runs}) > 1]


def label_runs(runs: list[Run]) -> list[str]:
    """Sets each run's params and label; returns the differing keys. A lone run is labelled by its folder."""
    keys = differing_keys(runs)
    for run in runs:
        run.params = {key: run.value(key) or "" for key in keys}
        run.label = " ".join(f"{key}={value}" for key, value in run.params.items()) or run.path.name
    _disambiguate(runs)
    return keys


def _disambiguate(runs: list[Run]) -> None:
    """Runs with equal settings (repeats) keep apart by their folder name."""
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label = f"{run.label} [{run.path.name}]".strip()
