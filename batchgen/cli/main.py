"""The command line: Hydra composes conf/ into a `Config`, which is validated and run. The only Hydra importer."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from batchgen.cli.config_keys import check_known_keys
from batchgen.cli.exits import EXIT_BAD_CONFIG_OR_INPUT, EXIT_CRASH, remove_unstarted_run_dir
from batchgen.cli.package_files import package_file
from batchgen.cli.usage import early_exit
from batchgen.config import Config, ConfigError, validate
from batchgen.io.errors import InputError
from batchgen.job.stop_signals import JobStopped, resume_command
from batchgen.report.answers import exact_match
from batchgen.report.run_brief import brief_table
from batchgen.report.summary_fields import read_figures
from batchgen.runners.errors import MergeError, RankFailedError

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"

log = logging.getLogger("batchgen")

ConfigStore.instance().store(name="schema", node=Config)
if not OmegaConf.has_resolver("repo"):
    # ${repo:} lets configs name files shipped in the repository from whatever directory the job starts in.
    OmegaConf.register_new_resolver("repo", lambda: str(REPO_ROOT))
if not OmegaConf.has_resolver("package_file"):
    # ${package_file:DISTRIBUTION,PATTERN}: a data file inside an installed Python package (conf/model/smollm2.yaml).
    OmegaConf.register_new_resolver("package_file", package_file)


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as plain dataclasses, validated; errors name the key."""
    try:
        check_known_keys(OmegaConf.to_container(cfg, resolve=False))
        config = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        if isinstance(exc, InterpolationResolutionError) and exc.full_key:  # a resolver's error names no key
            message = f"{exc.full_key}: {message}"
        raise ConfigError(message) from None
    return validate(config)


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
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        config = to_config(cfg)
        from batchgen.runners.launch import launch  # torch and the engine load only once the config is valid

        # The imported modules' objects (mostly torch's) live as long as the process: left out of every later
        # collection, a full one (the engine's close, Python's own) takes microseconds instead of 0.2 s.
        gc.freeze()
        summary = launch(config, run_dir, list(HydraConfig.get().overrides.task))
    except (ConfigError, InputError) as exc:
        log.error("%s", exc)
        remove_unstarted_run_dir(run_dir)
        sys.exit(EXIT_BAD_CONFIG_OR_INPUT)
    except JobStopped as stop:
        remove_unstarted_run_dir(run_dir)
        print(f"{stop}; resume with: {resume_command(list(HydraConfig.get().overrides.task), run_dir)}",
              file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except (MergeError, RankFailedError) as exc:
        log.error("%s", exc)
        sys.exit(EXIT_CRASH)
    print(brief_table(summary))
    answers = exact_match(run_dir, {"path": config.data.path, "format": config.data.format})
    if answers is not None:
        print(answers.line())
    return read_figures(summary).output_tok_s


class MergeShardsCallback(Callback):
    """After a multirun over data.shard_index (e.g. a SLURM array of shard jobs), merges the shards into the
    sweep directory; a sweep without data.num_shards > 1 is left alone."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.data.num_shards > 1:
            from batchgen.runners.merge import merge_shards  # pyarrow: only for a sharded sweep

            summary = merge_shards(Path(config.hydra.sweep.dir))
            log.info("Merged %d shards, %d rows -> %s", summary["num_shards"], summary["rows"],
                     config.hydra.sweep.dir)


def main() -> None:
    text = early_exit(sys.argv[1:])
    if text is not None:
        print(text)
        return
    try:
        _main()
    except SystemExit as exc:
        if exc.code == EXIT_CRASH and not _reached_job:
            sys.exit(EXIT_BAD_CONFIG_OR_INPUT)
        raise
