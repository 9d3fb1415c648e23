"""The command line: Hydra composes conf/ into a `Config`, which is validated and run. The only Hydra importer."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchgen.config import Config, ConfigError, validate
from batchgen.io.errors import InputError
from batchgen.report.run_brief import brief_table
from batchgen.report.summary_fields import read_figures
from batchgen.runners.data_parallel import RankFailedError
from batchgen.runners.launch import launch
from batchgen.runners.merge import MergeError, merge_shards

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"

log = logging.getLogger("batchgen")

ConfigStore.instance().store(name="schema", node=Config)
if not OmegaConf.has_resolver("repo"):
    # ${repo:} lets configs name files shipped in the repository from whatever directory the job starts in.
    OmegaConf.register_new_resolver("repo", lambda: str(REPO_ROOT))


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as plain dataclasses, validated; errors name the key."""
    try:
        config = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None
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


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(cfg: DictConfig) -> float | None:
    """Returns the run's output tok/s, the figure Hydra's optimising sweepers maximise."""
    try:
        config = to_config(cfg)
        hydra_config = HydraConfig.get()
        summary = launch(config, Path(hydra_config.runtime.output_dir), list(hydra_config.overrides.task))
    except (ConfigError, InputError) as exc:
        log.error("%s", exc)
        sys.exit(2)
    except (MergeError, RankFailedError) as exc:
        log.error("%s", exc)
        sys.exit(1)
    print(brief_table(summary))
    return read_figures(summary).output_tok_s


class MergeShardsCallback(Callback):
    """After a multirun over data.shard_index (e.g. a SLURM array of shard jobs), merges the shards into the
    sweep directory; a sweep without data.num_shards > 1 is left alone."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.data.num_shards > 1:
            summary = merge_shards(Path(config.hydra.sweep.dir))
            log.info("Merged %d shards, %d rows -> %s", summary["num_shards"], summary["rows"],
                     config.hydra.sweep.dir)


def main() -> None:
    _main()
