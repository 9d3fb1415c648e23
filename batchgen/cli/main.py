"""The command line: Hydra composes conf/ into a `Config`, which is validated and run. The only Hydra importer."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from batchgen.cli.config_keys import check_known_keys, check_override_keys
from batchgen.cli.package_files import package_file
from batchgen.cli.usage import config_groups
from batchgen.config import Config, ConfigError, validate
from batchgen.io.atomic import DirectoryInUse
from batchgen.io.errors import InputError
from batchgen.job import process_clock
from batchgen.job.exits import (
    EXIT_BAD_CONFIG_OR_INPUT,
    EXIT_CRASH,
    EXIT_ENVIRONMENT,
    describe_os_error,
    end_process,
    is_environment_fault,
    job_ends_process,
    remove_unstarted_run_dir,
)
from batchgen.job.stop_signals import JobStopped, resume_command
from batchgen.models.hf_config import check_checkpoint
from batchgen.models.hub import resolve_model
from batchgen.report.answers import exact_match
from batchgen.report.run_brief import brief_table
from batchgen.report.summary_fields import read_figures
from batchgen.runners.errors import MergeError, RankFailedError
from batchgen.tp.errors import FollowerExited
from batchgen.worker.compile_pool import start_ahead_of_torch

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

log = logging.getLogger("batchgen")


def writable(node: DictConfig) -> DictConfig:
    """The schema, its frozen dataclasses' nodes made writable: Hydra merges conf/ and the command line into it."""
    OmegaConf.set_readonly(node, False)
    for value in node.values():
        if isinstance(value, DictConfig):
            writable(value)
    return node


ConfigStore.instance().store(name="schema", node=writable(OmegaConf.structured(Config)))
if not OmegaConf.has_resolver("repo"):
    # ${repo:} lets configs name files shipped in the repository from whatever directory the job starts in.
    OmegaConf.register_new_resolver("repo", lambda: str(REPO_ROOT))
if not OmegaConf.has_resolver("package_file"):
    # ${package_file:DISTRIBUTION,PATTERN}: a data file inside an installed Python package (conf/model/smollm2.yaml).
    OmegaConf.register_new_resolver("package_file", package_file)


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as plain dataclasses, validated, its checkpoint checked; errors name the key."""
    try:
        check_known_keys(OmegaConf.to_container(cfg, resolve=False))
        config = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        if isinstance(exc, InterpolationResolutionError) and exc.full_key:  # a resolver's error names no key
            message = f"{exc.full_key}: {message}"
        raise ConfigError(message) from None
    validate(config)
    config = replace(config, model=resolve_model(config.model))  # a Hub id becomes its local snapshot directory
    check_checkpoint(config.model, config.engine.max_model_len, config.engine.tensor_parallel_size)
    return config


class MultirunReport(Callback):
    """At the end of a multirun, writes the sweep's report into the multirun directory (conf/config.yaml)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        try:
            from batchgen.report.build import build_report, write_report
        except ImportError:
            log.warning('No sweep report: it needs pandas (pip install -e ".[report]")')
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        report_md = write_report(build_report([sweep_dir]), sweep_dir / "report")
        print(f"Sweep report: {report_md} and {report_md.with_suffix('.html')}")


_reached_job = False  # Hydra exits 1 on its own errors; before the job is reached they are configuration errors


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(cfg: DictConfig) -> float | None:
    """Returns the run's output tok/s, the figure Hydra's optimising sweepers maximise."""
    global _reached_job
    _reached_job = True
    process_clock.mark("hydra")  # the command line checked, the config composed, the run dir and log set up
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        config = to_config(cfg)
        process_clock.mark("config")
        start_ahead_of_torch(config)  # on a fresh GPU machine: the compile processes' imports beside this one's
        from batchgen.runners.launch import launch  # the engine's modules load only once the config is valid

        single_run = HydraConfig.get().mode == RunMode.RUN
        with job_ends_process() if single_run else contextlib.nullcontext():
            summary = launch(config, run_dir, list(HydraConfig.get().overrides.task))
    except (ConfigError, InputError, DirectoryInUse) as exc:
        log.error("%s", exc)
        remove_unstarted_run_dir(run_dir)
        sys.exit(EXIT_BAD_CONFIG_OR_INPUT)
    except JobStopped as stop:
        remove_unstarted_run_dir(run_dir)
        print(f"{stop}; resume with: {resume_command(list(HydraConfig.get().overrides.task), run_dir)}",
              file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except OSError as exc:
        if not is_environment_fault(exc):
            raise
        remove_unstarted_run_dir(run_dir)
        kept = (f"; what was written is kept: once that is fixed, resume with: "
                f"{resume_command(list(HydraConfig.get().overrides.task), run_dir)}" if run_dir.exists() else "")
        # Printed, not logged: on a full disk the log file cannot take it.
        print(f"{describe_os_error(exc)}{kept}", file=sys.stderr, flush=True)
        sys.exit(EXIT_ENVIRONMENT)
    except (MergeError, RankFailedError) as exc:
        log.error("%s", exc)
        sys.exit(EXIT_CRASH)
    except FollowerExited as exc:
        remove_unstarted_run_dir(run_dir)
        kept = (f"; the finished rows are kept: resume with: "
                f"{resume_command(list(HydraConfig.get().overrides.task), run_dir)}" if run_dir.exists() else "")
        log.error("%s%s", exc, kept)
        end_process(EXIT_CRASH)  # the teardown would abort on the collective aborted for the dead rank
    print(brief_table(summary))
    answers = exact_match(run_dir, {"path": config.data.path, "format": config.data.format})
    if answers is not None:
        print(answers.line())
    return read_figures(summary).output_tok_s


def exit_unless_writable(directory: Path, key: str) -> None:
    """Creates `directory` (the value of `key`) and checks that files can be made in it; if not, exits in one line:
    EXIT_ENVIRONMENT for a read-only or full file system, EXIT_BAD_CONFIG_OR_INPUT for a path that cannot be a
    directory (a file on the way)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            tempfile.TemporaryFile(dir=directory).close()
        except OSError as exc:  # named by the directory: the probe's own name means nothing to the user
            raise OSError(exc.errno, exc.strerror, str(directory)) from exc
    except OSError as exc:
        print(f"{key}={directory} cannot be written: {describe_os_error(exc)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_ENVIRONMENT if is_environment_fault(exc) else EXIT_BAD_CONFIG_OR_INPUT)


class WritableOutputDir(Callback):
    """Hydra makes the run directory and writes .hydra/ and its log there before batchgen runs, and reports a
    failure with a traceback; this checks the directory first (conf/config.yaml)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)  # as Hydra's run_job does before it reads the directory
        exit_unless_writable(Path(config.hydra.run.dir), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        HydraConfig.instance().set_config(config)
        exit_unless_writable(Path(config.hydra.sweep.dir), "hydra.sweep.dir")


class MergeShardsCallback(Callback):
    """After a multirun over data.shard_index (e.g. a SLURM array of shard jobs), merges the shards into the
    sweep directory; a sweep without data.num_shards > 1 is left alone."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.data.num_shards > 1:
            from batchgen.runners.merge import merge_shards  # pyarrow: only for a sharded sweep

            summary = merge_shards(Path(config.hydra.sweep.dir))
            log.info("Merged %d shards, %d rows -> %s", summary["num_shards"], summary["rows"],
                     config.hydra.sweep.dir)


def changed_keys(args: list[str]) -> list[str]:
    """The keys that the command line's plain `key=value` overrides set, read with Hydra's own parsers: not config
    groups (group=option), not Hydra's own keys; none for a command line that Hydra itself refuses."""
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        overrides = OverridesParser.create().parse_overrides(parser.parse_known_args(args)[0].overrides)
    except (argparse.ArgumentError, OverrideParseException):
        return []
    groups = config_groups(CONF_DIR)
    return [override.key_or_group for override in overrides if override.type == OverrideType.CHANGE
            and override.key_or_group not in groups and "/" not in override.key_or_group
            and override.key_or_group.partition(".")[0] != "hydra"]


def main() -> None:
    """Runs the job that the command line composes (batchgen/__main__.py answers --help and --version first)."""
    try:
        check_override_keys(changed_keys(sys.argv[1:]))
    except ConfigError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG_OR_INPUT)
    try:
        _main()
    except SystemExit as exc:
        if exc.code == EXIT_CRASH and not _reached_job:
            sys.exit(EXIT_BAD_CONFIG_OR_INPUT)
        raise
