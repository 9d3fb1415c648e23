"""The pooling a sentence-transformers checkpoint declares, the default of model.pooling (job.task=embed)."""

from __future__ import annotations

import json
from pathlib import Path

POOLING_MODULE = "sentence_transformers.models.Pooling"
DEFAULT_POOLING_DIR = "1_Pooling"
# sentence-transformers' pooling_mode_* keys -> model.pooling's value
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def _pooling_dir(checkpoint: Path) -> Path:
    """The Pooling module's directory that modules.json names, else the usual 1_Pooling."""
    modules_file = checkpoint / "modules.json"
    if modules_file.is_file():
        for module in json.loads(modules_file.read_text(encoding="utf-8")):
            if module.get("type") == POOLING_MODULE:
                return checkpoint / module.get("path", DEFAULT_POOLING_DIR)
    return checkpoint / DEFAULT_POOLING_DIR


def checkpoint_pooling(path: str | None) -> str | None:
    """last | mean | cls as the checkpoint's sentence-transformers Pooling config asks; None without one. A config
    asking for another pooling (max, weighted mean, several at once) raises naming the file and model.pooling."""
    if path is None:
        return None
    config_file = _pooling_dir(Path(path)) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    asked = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
    if len(asked) != 1 or asked[0] not in POOLING_MODES:
        raise ValueError(f"{config_file} asks for pooling {', '.join(asked) or '(none)'}; batchgen pools one of "
                         f"{', '.join(POOLING_MODES)}: set model.pooling=last, mean or cls")
    return POOLING_MODES[asked[0]]
