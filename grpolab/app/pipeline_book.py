"""The pipeline's bookkeeping in its folder: which stages finished, with which settings and on which input
files (grpolab.app.pipeline runs the stages).

    OUT/stages.json   each finished stage: its settings fingerprint, wall time and input digests
    OUT/inputs.json   each input file's size, mtime and SHA-256 (hashed again only when those change)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from grpolab.errors import ConfigError

STAGES = ("sft", "reward_models", "grpo", "eval")
STAGES_FILE = "stages.json"


def fingerprint(spec: Any) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Digests:
    """OUT/inputs.json: each input file's size, mtime and SHA-256; the hash is computed again only when
    the size or the mtime changed."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "inputs.json"
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}

    def of(self, path: Path) -> str:
        """The content digest of a file, or of a folder's files (names and contents)."""
        from grpolab.manifest import sha256

        if path.is_dir():
            parts = [f"{f.relative_to(path)}:{self.of(f)}" for f in sorted(path.rglob("*")) if f.is_file()]
            return hashlib.sha256("\n".join(parts).encode()).hexdigest()
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
        entry = self.known.get(key)
        if entry is None or entry["stamp"] != stamp:
            entry = self.known[key] = {"stamp": stamp, "sha256": sha256(path)}
            self.path.write_text(json.dumps(self.known, indent=1))
        return entry["sha256"]

    def of_stage(self, files: dict[str, Path]) -> dict[str, str]:
        return {field: self.of(path) for field, path in files.items() if path.exists()}


class Book:
    """OUT/stages.json: each finished stage's settings fingerprint and wall time."""

    def __init__(self, out_dir: Path, inputs: dict[str, dict[str, Path]] | None = None):
        self.path = out_dir / STAGES_FILE
        self.inputs, self.digests = inputs or {}, Digests(out_dir)
        try:
            self.stages = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.stages = {}

    def done(self, stage: str, spec: Any, finished: bool, inputs: dict[str, str] | None = None) -> bool:
        """Whether `stage` finished with these settings and input files (their digests); a ConfigError
        when it finished with other settings or on input files whose content has changed since."""
        entry = self.stages.get(stage)
        if not finished or entry is None:
            return False
        again = (f"add --from {stage.split(':')[0]} to redo it and the stages after it (their folders are moved "
                 "aside, nothing is deleted)")
        if entry["fingerprint"] != fingerprint(spec):
            raise ConfigError(f"pipeline stage {stage!r} finished with other settings than the file now gives; "
                              f"{again}")
        changed = [k for k, v in (inputs or {}).items() if entry.get("inputs", {}).get(k, v) != v]
        if changed:
            raise ConfigError(f"pipeline stage {stage!r} finished on other input files: {', '.join(changed)} "
                              f"changed since; {again}")
        return True

    def record(self, stage: str, spec: Any, seconds: float, inputs: dict[str, str] | None = None) -> None:
        self.stages[stage] = {"fingerprint": fingerprint(spec), "seconds": round(seconds, 1),
                              "inputs": inputs or {}}
        self.path.write_text(json.dumps(self.stages, indent=1))

    def forget_from(self, stage: str) -> None:
        keep = STAGES[: STAGES.index(stage)]
        self.stages = {k: v for k, v in self.stages.items() if k.split(":")[0] in keep}
        self.path.write_text(json.dumps(self.stages, indent=1))
