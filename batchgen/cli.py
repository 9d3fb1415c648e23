"""The command line: Hydra composes conf/ into a `Config`, which is validated and run. The only Hydra importer."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from batchgen.config import Config, ConfigError, validate
from batchgen.io.errors import InputError

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


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(cfg: DictConfig) -> None:
    try:
        config = to_config(cfg)
        from batchgen.job import run  # torch, pyarrow and the engine load only once the config is valid

        run(config, Path(HydraConfig.get().runtime.output_dir))
    except (ConfigError, InputError) as exc:
        log.error("%s", exc)
        sys.exit(2)


def main() -> None:
    _main()
