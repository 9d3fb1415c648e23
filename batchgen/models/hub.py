"""Models by Hugging Face Hub id: `model.path=Qwen/Qwen3-0.6B` (or `...@revision`) becomes the local snapshot
directory that huggingface_hub keeps in its cache (HF_HOME, HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads only the cache).

Resolved once, before anything reads the path (the checkpoint check, the tokenizer, the loader), so everything after
sees a plain local directory. A local path that exists always wins over an id of the same spelling. Only the files
batchgen reads are downloaded: config.json, generation_config.json, the tokenizer's files and the safetensors weights
(those model.safetensors.index.json names, or model.safetensors). PyTorch pickles (*.bin) are never downloaded and
never read: unpickling runs code.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # config.py imports this module to accept ids: it cannot be imported from here at load time
    from batchgen.config import ModelConfig

# A Hub repository id, as huggingface_hub validates it: an optional namespace, a name of word characters, "-" and
# ".", no "--" or ".." (parse_hub_id checks those, and splits off an "@revision": a branch, tag or commit).
_REPO_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+")
TOKENIZER_PATTERNS = ["tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "chat_template*", "spiece.model"]
METADATA_PATTERNS = ["config.json", "generation_config.json", *TOKENIZER_PATTERNS]
WEIGHT_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None  # None: the default branch

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_id(path: str) -> HubId | None:
    """path as a Hub id (org/name, name, either with @revision); None when it cannot be one (an absolute or relative
    file path such as /models/x, ./x, ~/x)."""
    repo_id, _, revision = path.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.startswith((".", "-")):
        return None
    if "@" in path and not revision:
        return None
    return HubId(repo_id, revision or None)


def is_hub_id(path: str | None) -> bool:
    """Whether model.path names a Hub model rather than a local file: no such local path, and an id's spelling."""
    return path is not None and not os.path.exists(path) and parse_hub_id(path) is not None


def resolve_model(model: ModelConfig) -> ModelConfig:
    """model with model.path and model.tokenizer made local directories where they are Hub ids (downloading what is
    not cached yet), and model.served_model_name defaulting to the id (not the snapshot directory's commit hash).
    Raises ConfigError, one line naming the key, when an id cannot be resolved."""
    path, tokenizer, served = model.path, model.tokenizer, model.served_model_name
    if is_hub_id(model.path):
        hub_id, where = parse_hub_id(model.path), f"model.path={model.path}"
        dummy = model.load_format == "dummy"  # random weights: config.json and the tokenizer are all it reads
        path = _download(hub_id, METADATA_PATTERNS, where) if dummy else _download_checkpoint(hub_id, where)
        served = served or hub_id.repo_id
    if is_hub_id(model.tokenizer):
        tokenizer = _download(parse_hub_id(model.tokenizer), METADATA_PATTERNS, f"model.tokenizer={model.tokenizer}")
    return replace(model, path=path, tokenizer=tokenizer, served_model_name=served)


def _download_checkpoint(hub_id: HubId, where: str) -> str:
    """The snapshot directory with config, tokenizer and the safetensors files the loader reads: first the metadata
    and the weights index, then the shards the index names, from the same commit."""
    directory = _download(hub_id, [*METADATA_PATTERNS, WEIGHT_INDEX, SINGLE_WEIGHTS], where)
    index = Path(directory) / WEIGHT_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        except (json.JSONDecodeError, AttributeError):
            shards = []  # check_checkpoint names what is wrong with the index
        if shards:
            commit = HubId(hub_id.repo_id, Path(directory).name)  # the snapshot directory is named by its commit
            _download(commit, shards, where)
    return directory


def _download(hub_id: HubId, patterns: list[str], where: str) -> str:
    from huggingface_hub import constants, snapshot_download  # about a second of imports: only for an id
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        # Offline, the cache alone answers: some huggingface_hub versions still list a commit's files online.
        return snapshot_download(hub_id.repo_id, revision=hub_id.revision, allow_patterns=patterns,
                                 local_files_only=constants.HF_HUB_OFFLINE)
    except GatedRepoError:
        reason = f"{hub_id.repo_id} is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN"
    except RepositoryNotFoundError:
        reason = f"the Hugging Face Hub has no model {hub_id.repo_id} (or it is private: set HF_TOKEN)"
    except RevisionNotFoundError:
        reason = f"{hub_id.repo_id} has no revision {hub_id.revision!r} on the Hugging Face Hub"
    except LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        reason = (f"{hub_id} is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it"
                  if constants.HF_HUB_OFFLINE else
                  f"{hub_id} is not in the Hugging Face cache {cache} and the Hub could not be reached")
    except HFValidationError as error:
        reason = f"not a valid Hugging Face Hub id ({str(error).splitlines()[0]})"
    except HfHubHTTPError as error:
        reason = f"the Hugging Face Hub refused {hub_id} ({str(error).splitlines()[0]})"
    from batchgen.config import ConfigError

    raise ConfigError(f"{where}: no such local directory, and {reason}")
