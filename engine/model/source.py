"""Where a model's files are: a local checkpoint directory, or a Hugging Face model id resolved through
the local Hugging Face cache (downloaded into it when the network is allowed)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Only what the loader reads: configs, tokenizer files, safetensors weights. Never code or pickles.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model_path(model: str) -> str:
    """Absolute path of a checkpoint directory.

    `model` is tried as a path (absolute; else relative to the cwd, then to the repository root), then
    as a Hugging Face model id (`org/name`): the snapshot in the local HF cache (`HF_HUB_CACHE` /
    `HF_HOME`), else a download of the checkpoint files into that cache, unless `HF_HUB_OFFLINE=1`.
    """
    p = Path(model).expanduser()
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), REPO_ROOT):
        if (base / p).exists():
            return str((base / p).resolve())
    if not _REPO_ID.match(model):
        raise FileNotFoundError(f"no checkpoint directory {model!r} (looked in {Path.cwd()} and {REPO_ROOT}), "
                                "and it is not a Hugging Face model id (org/name)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, allow_patterns=CHECKPOINT_FILES, local_files_only=True)
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"{model!r} is neither a local directory nor in the Hugging Face cache "
                                    f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set") from None
    return snapshot_download(model, allow_patterns=CHECKPOINT_FILES)
