"""A folder's integrity manifest: `grpolab_manifest.json` lists every file grpolab wrote into a model
folder (a run's final/, a reward model) with its size and SHA-256, written last. Every reader that
loads such a folder checks it first (`check_manifest`), so a damaged or cut file is named instead of
being loaded or failing inside a library; a folder without a manifest (any HF folder) is read as it is.

    {"files": {"model.safetensors": {"size": 123, "sha256": "..."}, ...}}
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "grpolab_manifest.json"
SKIP = (MANIFEST, "run.json", ".grpolab.lock")
"""Files a manifest never lists (itself, and files that change after it is written)."""


def sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: str | os.PathLike) -> Path:
    """Writes `folder`/grpolab_manifest.json for the files now in it (fsynced); returns its path."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in SKIP}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def check_manifest(folder: str | os.PathLike, what: str = "model folder") -> None:
    """ValueError naming the file when a file listed in `folder`'s manifest is missing, has another
    size or another SHA-256; nothing when the folder has no manifest."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{what} {folder}: {MANIFEST} is damaged (not the manifest grpolab writes)") from None
    for name, entry in files.items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != entry.get("size"):
            got = f"{f.stat().st_size} bytes" if f.is_file() else "missing"
            raise ValueError(f"{what} {folder}: {name} is damaged ({got}; {MANIFEST} says {entry.get('size')} bytes)")
        if sha256(f) != entry.get("sha256"):
            raise ValueError(f"{what} {folder}: {name} is damaged (its content does not match the SHA-256 "
                             f"{MANIFEST} recorded when it was written)")
