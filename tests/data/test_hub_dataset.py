"""data.source=hf:org/name reads a hub dataset already in the Hugging Face cache by its id, offline
(HF_HUB_OFFLINE=1): a tiny dataset is put into a temporary HF_HOME the way the hub cache lays it out
(datasets--org--name/refs/main, snapshots/<commit>/data/train.parquet), then a fresh process reads it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROWS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(5)]
READ = """
import json, sys
from grpolab import config as C
from grpolab.data.build import prompt_stream
from grpolab.data.sources import load_hf_dataset
from grpolab.models.policy import load_policy
cfg = C.from_preset("grpo", ["data.source=hf:org/tiny", "model.hidden_size=32", "model.num_layers=1"])
stream = prompt_stream(cfg, load_policy(cfg)[1])
print(json.dumps([[it.prompt, it.meta] for it in stream.items]))
try:
    load_hf_dataset("org/missing")
except FileNotFoundError as e:
    print(e, file=sys.stderr)
"""


def _hub_cache(home: Path) -> None:
    repo = home / "hub" / "datasets--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    data = repo / "snapshots" / COMMIT / "data"
    data.mkdir(parents=True)
    datasets.Dataset.from_list(ROWS).to_parquet(str(data / "train.parquet"))


def test_hf_org_name_reads_the_cached_hub_dataset_offline(tmp_path):
    home = tmp_path / "hf"
    _hub_cache(home)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache"), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", READ], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    items = json.loads(out.stdout.splitlines()[-1])
    assert sorted(p for p, _ in items) == sorted(r["prompt"] for r in ROWS)
    assert all(meta["answer"] == str(int(p[:-3]) + 1) for p, meta in items)  # the rows' other fields as metadata
    assert "'org/missing'" in out.stderr and "HF_HUB_OFFLINE=1" in out.stderr
