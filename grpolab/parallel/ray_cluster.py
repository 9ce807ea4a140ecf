"""Joining a Ray cluster (or starting a local one): what the Ray rollout workers, reward workers and
trainer ranks share."""

from __future__ import annotations

import os
import re
import uuid


def require_ray():
    """The ray module, or an error naming the extra to install."""
    from grpolab.optional import require

    return require("ray", "ray")


def connect(cfg, actors: int, address: str = "") -> None:
    """Joins the Ray cluster this process already belongs to (a trainer actor), the one at `address`
    (`grpolab train --ray ADDRESS`), or starts a local one (no dashboard) with room for `actors`
    actors of run.threads CPUs each (at least this machine's CPU count: Ray's CPUs here are places
    for actors, not cores)."""
    ray = require_ray()
    if ray.is_initialized():
        return
    namespace = f"grpolab-{uuid.uuid4().hex[:8]}"
    if address and address != "local":
        ray.init(address=address, namespace=namespace, log_to_driver=True)
        return
    ray.init(num_cpus=max(os.cpu_count() or 1, actors * max(1, cfg.run.threads)), include_dashboard=False,
             log_to_driver=True, namespace=namespace, runtime_env=local_runtime_env())


def local_runtime_env() -> dict:
    """The actors of a local cluster import what this process imports: its working directory and
    PYTHONPATH (a reward given as 'module:attr' from the current folder)."""
    path = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(path)}}


def gather(refs: list, owners: list[str], what: str) -> list:
    """ray.get(refs), where refs[i] is a call on the actor that owners[i] names ("rollout worker 1 of
    2 (Ray actor grpolab-...)"). An actor that died (ray.exceptions.RayActorError: killed, its process
    ended) is one WorkerLostError naming it, why it ended and what to do, instead of Ray's traceback."""
    from grpolab.errors import WorkerLostError

    ray = require_ray()
    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as first:
        lost = first
    for ref, owner in zip(refs, owners):  # which actor it was
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            lost = e
            break
    else:
        owner = "a worker"
    text = " ".join(str(lost).split())
    why = re.search(r"dead because (.*?)\.(?: |$)", text)
    pid = re.search(r"\bpid: (\d+)", text)
    if pid:
        owner = f"{owner[:-1]}, pid {pid.group(1)})" if owner.endswith(")") else f"{owner} (pid {pid.group(1)})"
    raise WorkerLostError(
        f"{owner} died during {what}"
        f"{f': {why.group(1)}' if why else ''}. The run stops here and keeps its last complete checkpoint: run "
        "the same command with --resume to continue it (its workers are started again)") from None
