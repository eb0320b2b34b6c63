"""Where a model's files are: a local checkpoint directory, or a Hugging Face model id resolved through
the local Hugging Face cache (downloaded into it when the network is allowed), checked to hold what
the engine loads before anything starts."""

from __future__ import annotations

import re
from pathlib import Path

from engine.errors import CheckpointError
from engine.model.checkpoint import load_model_spec, weight_files

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

# Only what the loader reads: configs, tokenizer files, safetensors weights. Never code or pickles.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]
_REPO_ID = re.compile(r"^[\w-][\w.-]*/[\w.-]+$")  # `org/name`: never absolute, never ./ or ../


def check_checkpoint(root: Path) -> None:
    """Raise CheckpointError naming everything the directory `root` lacks to be served: config.json
    (with a supported model_type), safetensors weights, tokenizer.json."""
    if not root.is_dir():
        raise CheckpointError(f"model path {str(root)!r} is not a directory")
    weights = any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").is_file()
    missing = [what for what, present in (("config.json", (root / "config.json").is_file()),
                                          ("weights (*.safetensors)", weights),
                                          ("tokenizer.json", (root / "tokenizer.json").is_file())) if not present]
    if missing:
        raise CheckpointError(f"model path {str(root)!r} is not a checkpoint directory: it has no "
                              f"{', no '.join(missing)}")
    load_model_spec(root)  # config.json readable, model_type supported, required fields present
    weight_files(root)  # an index's shards all present


def _local_dir(model: str) -> tuple[Path | None, list[Path]]:
    """The existing path `model` names (absolute; else relative to the cwd, then to the repository
    root), and the places looked at."""
    p = Path(model).expanduser()
    places = [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, REPO_ROOT / p]))
    return next((q.resolve() for q in places if q.exists()), None), places


def _from_hub(model: str, looked: str) -> str:
    """The snapshot directory of Hugging Face model id `model`: the local cache's, else a download of
    the checkpoint files (unless HF_HUB_OFFLINE). FileNotFoundError names both things tried."""
    from huggingface_hub import constants, snapshot_download

    def not_found(why: str) -> FileNotFoundError:
        return FileNotFoundError(f"model {model!r} is neither a directory ({looked}) nor a Hugging Face model "
                                 f"id that could be loaded: {why}")

    try:
        return snapshot_download(model, allow_patterns=CHECKPOINT_FILES, local_files_only=True)
    except (OSError, ValueError):  # not in the cache, or not a valid id
        if constants.HF_HUB_OFFLINE:
            raise not_found(f"not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is "
                            "set") from None
    try:
        return snapshot_download(model, allow_patterns=CHECKPOINT_FILES)
    except (OSError, ValueError) as e:  # unknown repository, no network, gated, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise not_found(f"not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and downloading it failed "
                        f"({type(e).__name__}: {first})") from None


def resolve_model_path(model: str) -> str:
    """Absolute path of a checkpoint directory, checked by `check_checkpoint`.

    `model` is tried as a path (absolute; else relative to the cwd, then to the repository root). Only
    when no such path exists and `model` is shaped like a Hugging Face model id (`org/name`) is it
    looked up there: the snapshot in the local HF cache (`HF_HUB_CACHE` / `HF_HOME`), else a download
    of the checkpoint files into that cache, unless `HF_HUB_OFFLINE=1`. A path that does not exist is a
    CheckpointError naming where it was looked for; an id found nowhere a FileNotFoundError naming
    both tries.
    """
    local, places = _local_dir(model)
    if local is None:
        looked = "no such path: " + " or ".join(str(p) for p in places)
        if not _REPO_ID.match(model):
            raise CheckpointError(f"model path {model!r} is not a directory ({looked})")
        local = Path(_from_hub(model, looked))
    check_checkpoint(local)
    return str(local)
