"""Run directories are never overwritten: a command claims its folder first (`claim`, `make_run_dir`);
`write_config` and `write_eval` write its config.yaml and eval.json, `model_folder` finds its final/.

A folder holds a run when it has results worth keeping (`holds_run`: logged steps, checkpoints,
final/, eval.json, a reward model, or a run recorded as finished). Claiming such a folder is refused unless the
command continues that run (`--resume`, same command) or was given `--overwrite`, which moves the
old run aside (`DIR.old-<time>`), never deletes it. `run.json` records the command and whether the
run finished, independent of its checkpoints:

    {"command": "train", "status": "running" | "finished" | "failed" | "stopped", "started": "...",
     "finished": "...", "error": "..."}

A command that raises records "failed" and the error (`recording_failure`); one stopped by a signal
or Ctrl-C records "stopped" (resumable where the command resumes).

One process writes a folder at a time: `claim` first takes the folder's lock (grpolab.rundir.lock),
held until the command ends, so a second run, resume or command into a folder in use is refused
naming the holder's PID and command. A folder grpolab never claimed (no run.json) that holds other
files is the user's: it is refused too (`--overwrite` moves it aside). `claim_files` is the rule of a
command that writes fixed file names into a folder users keep data in (`grpolab data`): it rewrites
only the files it wrote there before and that are unchanged since (their SHA-256 in run.json).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from grpolab import config as C
from grpolab.errors import ConfigError
from grpolab.rundir.lock import LOCK_FILE, lock_folder, release

RUN_FILE = "run.json"
RESULTS = ("final", "eval.json", "grpolab_rm.json")
"""Files and folders that make a folder hold a run by being there (besides logged steps,
checkpoints and a finished run.json)."""


def holds_run(path: Path) -> bool:
    """Whether `path` holds results worth keeping: logged steps, checkpoints, a model, an evaluation,
    or a run recorded as finished (a run that failed before its first step leaves only run.json and
    config.yaml, and its folder can be used again)."""
    if not path.is_dir():
        return False
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    if any((path / "checkpoints").glob("step-*")) or read_run(path).get("status") == "finished":
        return True
    return any((path / name).exists() for name in RESULTS)


def read_run(path: Path) -> dict:
    """run.json of `path` ({} when it has none or it is unreadable)."""
    try:
        info = json.loads((path / RUN_FILE).read_text())
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(path: Path) -> str:
    info = read_run(path)
    command = info.get("command", "grpolab")
    status = info.get("status") or ("finished" if (path / "final").exists() else "unfinished")
    article = "an" if status[0] in "aeiou" else "a"
    steps = [p.name for p in (path / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    latest = f" (checkpoints up to {max(steps, key=lambda n: int(n[5:]))})" if steps else ""
    return f"{article} {status} {command} run{latest}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def _write(path: Path, info: dict) -> None:
    tmp = path / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path / RUN_FILE)


def move_aside(path: Path, field: str = "run.out_dir") -> Path:
    """Renames the run at `path` to `path.old-<time>[-n]` (nothing is deleted); returns the new name.
    A folder another process holds (its lock) is refused (FolderBusyError); this process's lock of it
    is given back, as the folder is no longer at `path`."""
    path = Path(path)
    if path.is_dir():
        lock_folder(path, field)  # refuses a folder in use by another process
        release(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        dest = path.with_name(f"{path.name}.old-{stamp}" + (f"-{n}" if n else ""))
        if not dest.exists():
            os.rename(path, dest)
            return dest
    raise ConfigError(f"cannot move {path} aside: too many {path.name}.old-{stamp}* folders")


def _foreign(path: Path) -> list[str]:
    """The entries of a folder grpolab never claimed (no run.json): the user's files ([] otherwise)."""
    if not path.is_dir() or (path / RUN_FILE).exists():
        return []
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)


def _refuse_foreign(path: Path, names: list[str], field: str) -> ConfigError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return ConfigError(f"{field}={str(path)!r} holds files grpolab did not write ({shown}); choose another "
                       "folder, or add --overwrite to move them aside (nothing is deleted)")


def claim(path: Path, command: str, *, resume: bool = False, overwrite: bool = False,
          field: str = "run.out_dir", say=print) -> Path:
    """Makes `path` the folder of a new (or, with `resume`, continued) `command` run, held by this
    process (its lock) until the command ends, and records it in run.json; refuses a folder in use by
    another process, holding another run, or holding the user's own files (ConfigError naming `field`
    and the ways out)."""
    path = lock_folder(Path(path), field)
    run = holds_run(path)
    if run or _foreign(path):
        previous = read_run(path).get("command")
        if overwrite:
            say(f"grpolab: moved what was in {path} to {move_aside(path, field)}")
            lock_folder(path, field)
        elif not run:
            raise _refuse_foreign(path, _foreign(path), field)
        elif not resume:
            how = "add --resume to continue it, " if command == "train" else ""
            raise ConfigError(f"{field}={str(path)!r} already holds {_describe(path)}; {how}add --overwrite to move "
                              "it aside (nothing is deleted), or choose another folder")
        elif previous not in (None, command):
            again = f"grpolab {command} --resume" if command in ("train", "demo") else f"grpolab {command}"
            raise ConfigError(f"{field}={str(path)!r} holds {_describe(path)}, which `{again}` cannot continue; "
                              "choose another folder (or --overwrite to move it aside)")
    info = read_run(path) if resume else {}
    _write(path, {**info, "command": command, "status": "running", "started": info.get("started", _now())})
    return path


def mark_finished(path: Path) -> None:
    """Records in run.json that the run at `path` finished."""
    _write(path, {**read_run(path), "status": "finished", "finished": _now()})


def mark_stopped(path: Path, error: str = "", status: str = "failed") -> None:
    """Records in run.json that the run at `path` ended unfinished: `status` failed (with the error) or stopped."""
    _write(path, {**read_run(path), "status": status, "ended": _now(), **({"error": error[:500]} if error else {})})


@contextlib.contextmanager
def recording_failure(path: Path, enabled: bool = True):
    """Runs the block; an exception leaving it marks the run at `path` failed (KeyboardInterrupt: stopped)
    in run.json before it propagates. enabled=False (ranks other than 0) records nothing."""
    try:
        yield
    except BaseException as e:
        if enabled and path.is_dir():
            stopped = isinstance(e, KeyboardInterrupt)
            mark_stopped(path, "" if stopped else f"{type(e).__name__}: {e}", "stopped" if stopped else "failed")
        raise


def model_folder(path) -> str:
    """An HF folder as given, or a run directory's final/."""
    path = Path(path)
    return str(path / "final" if (path / "final" / "config.json").is_file() else path)


def make_run_dir(cfg: C.Config, default_name: str = "grpo", *, command: str = "train", resume: bool = False,
                 overwrite: bool = False) -> Path:
    """cfg.run.out_dir, or a new runs/<name>-<timestamp> folder, claimed for `command`
    (`claim`: a folder holding another run is refused unless resumed or overwritten)."""
    if cfg.run.out_dir:
        path = Path(cfg.run.out_dir)
    else:
        path = Path("runs") / f"{default_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return claim(path, command, resume=resume, overwrite=overwrite,
                 say=lambda msg: print(msg, file=sys.stderr))


def write_config(cfg: C.Config, run_dir: Path) -> None:
    C.dump(cfg, str(run_dir / "config.yaml"))


def write_eval(run_dir: Path, payload: dict) -> None:
    tmp = run_dir / "eval.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(run_dir / "eval.json")


def _sha256(path: Path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def claim_files(path: Path, command: str, names: list[str], *, overwrite: bool = False, field: str = "--out",
                say=print) -> Path:
    """Claims `path` (held by this process) for a command that writes the files `names` into it, among
    files of the user's: refused while one of `names` exists that this command did not write there, or
    has been changed since (run.json's "outputs" records their SHA-256); --overwrite moves the folder
    aside first. Other files of the folder are left alone."""
    path = lock_folder(Path(path), field)
    info = read_run(path)
    written = info.get("outputs", {}) if info.get("command") == command else {}
    clash = [n for n in names
             if (path / n).exists() and not ((path / n).is_file() and written.get(n) == _sha256(path / n))]
    if clash and overwrite:
        say(f"grpolab: moved what was in {path} to {move_aside(path, field)}")
        lock_folder(path, field)
        info = {}
    elif clash:
        raise ConfigError(f"{field}={str(path)!r} holds {', '.join(clash)}, which grpolab {command} did not write "
                          "(or which changed since); choose another folder, or add --overwrite to move the folder "
                          "aside (nothing is deleted)")
    _write(path, {**info, "command": command, "status": "running", "started": _now()})
    return path


def record_outputs(path: Path, files: list[Path]) -> None:
    """Records in run.json the SHA-256 of the files a claim_files command wrote, and that it finished."""
    outputs = {Path(f).name: _sha256(Path(f)) for f in files}
    _write(path, {**read_run(path), "outputs": outputs, "status": "finished", "finished": _now()})
