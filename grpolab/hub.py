"""Folders from the Hugging Face hub cache, the way transformers and datasets get them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def hub_folder(repo_id: str, what: str, **options: Any) -> Path:
    """The local snapshot of hub repository `repo_id` (`what`: "model" or "dataset") in the Hugging Face
    cache (HF_HOME / HF_HUB_CACHE), downloaded when missing unless HF_HUB_OFFLINE=1; options go to
    `huggingface_hub.snapshot_download`. FileNotFoundError naming the id when it is neither cached nor
    reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=what, **options))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{what} {repo_id!r}: no such local file or folder, not in the Hugging Face cache "
                                "(HF_HOME / HF_HUB_CACHE), and the hub cannot be reached (HF_HUB_OFFLINE=1 or no "
                                "network); download it where there is a network, or give a local path") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise FileNotFoundError(f"{what} {repo_id!r}: cannot be fetched from the Hugging Face hub "
                                f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
