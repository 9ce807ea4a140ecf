"""rollout.env_workers: environments stepped on Ray actors. A batch's slow environment calls run at the
same time, a call that hangs ends its episode as an environment error within env_timeout_s and its actor
is replaced, and every other episode is the one the in-process path records."""

from __future__ import annotations

import json
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from grpolab.agents.coroutines import Coroutines  # noqa: E402
from grpolab.agents.driver import EpisodeDriver  # noqa: E402
from grpolab.agents.envworkers import EnvPool  # noqa: E402
from grpolab.agents.episode import EpisodeBatch  # noqa: E402
from grpolab.agents.protocol import load_environment  # noqa: E402
from grpolab.grpo.episodes import episode_metrics, episode_rows  # noqa: E402
from grpolab.models.tiny import build_tiny_model  # noqa: E402
from grpolab.rollout.hf import HFEngine  # noqa: E402
from grpolab.rollout.multiturn import generate_episodes  # noqa: E402

ENV = "agents_fixtures:HangsOnItem"
ITEMS = [{"question": f"q{k}"} for k in range(8)]
ITEMS[2] = {"question": "q2", "hang": True}
ITEMS[5] = {"broken": True}
HUNG = 2
RAY_CPUS = 2


def _scripted_batch(tok, make_environment, items):
    """The episodes of `items` run as one batch (agents.coroutines), every turn "say <item's question>"."""
    coroutines = Coroutines()
    driver = EpisodeDriver(tok, coroutines.generate, make_environment, max_turns=3, max_episode_tokens=2000)

    def sample(requests):
        out = {}
        for i, (_ids, cap) in requests.items():
            ids = (tok.encode(f"say {items[i].get('question')}", add_special_tokens=False) + [driver.end_id])[:cap]
            out[i] = (ids, [0.0] * len(ids))
        return out

    try:
        return coroutines.run(driver, items, sample)
    finally:
        coroutines.close()


def test_a_hung_environment_ends_its_episode_and_the_others_match_the_in_process_path(ray_cluster, chat_tok):
    local = _scripted_batch(chat_tok, load_environment(ENV, {"turns": 2, "delay_s": 0.0}),
                            [it for k, it in enumerate(ITEMS) if k != HUNG])
    pool = EnvPool(ENV, {"turns": 2, "delay_s": 0.3}, workers=2, timeout_s=1.0)
    try:
        for batch in range(2):  # the second batch runs on the replaced actor
            pool.start()  # the actors (the replaced one in the second batch) are ready before the clock starts
            t0 = time.monotonic()
            remote = _scripted_batch(chat_tok, pool, ITEMS)
            wall = time.monotonic() - t0
            assert pool.timeouts == batch + 1 and pool.hung == {(batch * len(ITEMS) + HUNG) % 2}
            pool.end_batch()
            assert pool.restarts == batch + 1 and not pool.hung and all(not keys for keys in pool.hosted)
            assert [e for k, e in enumerate(remote) if k != HUNG] == local
            hung = remote[HUNG]
            assert hung.stop_reason == "env_error" and not hung.done and hung.turns == 1
            assert hung.env_error.startswith("HangsOnItem.step did not answer within 1 s (rollout.env_timeout_s)")
            assert remote[5].env_error == "HangsOnItem raised KeyError: 'no such level'"
            assert [e.reward for e in remote] == [1.0, 1.0, None, 1.0, 1.0, None, 1.0, 1.0]
            # one after another: 6 episodes x 2 steps x 0.3 s + the 1 s limit = 4.6 s; at once: about 1 s + 0.3 s
            # (the bound leaves room for a loaded 2-core machine and still fails calls made in turn)
            assert 1.0 < wall < 3.5, wall
        rows = episode_rows(EpisodeBatch(remote, 1, chat_tok.pad_token_id or 0, 0, {}), chat_tok.decode)
        assert episode_metrics(rows)["episode/env_errors"] == 2.0
    finally:
        pool.close()


def _tiny(tok):
    """A 2-layer, 32-wide char Qwen2 whose head favours <|im_end|>: turns of a few ids."""
    m = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=2048, seed=0).eval()
    head = torch.nn.Linear(32, len(tok), bias=True)
    head.weight = m.get_input_embeddings().weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 3.5
    m.lm_head = head
    return m


def test_the_hf_engine_samples_the_same_episodes_with_env_workers(ray_cluster, chat_tok):
    model = _tiny(chat_tok)
    engine = HFEngine(chat_tok, max_new_tokens=8, temperature=1.0)
    items = [{"question": f"q{k}"} for k in range(3)]
    kwargs = {"turns": 3, "delay_s": 0.05}
    pool = EnvPool(ENV, kwargs, workers=2, timeout_s=30.0)
    try:
        batches = [generate_episodes(engine, items, 2, make_environment=make, max_turns=3, max_turn_tokens=8,
                                     max_episode_tokens=1024, model=model,
                                     generator=torch.Generator().manual_seed(3))
                   for make in (load_environment(ENV, kwargs), pool)]
        assert all(not keys for keys in pool.hosted) and pool.timeouts == 0  # end_batch dropped them
    finally:
        pool.close()
    local, remote = (b.episodes for b in batches)
    assert remote == local and sum(e.turns for e in local) > len(local)  # environment turns did happen


def test_a_training_run_with_env_workers_logs_the_in_process_metrics(ray_cluster, tmp_path):
    """The config's path end to end (the setup's agent, the trainer's episodes, the run's close); the
    random tiny policy rarely ends a turn, so the steps are the other tests'."""
    from grpolab import config as C
    from grpolab.grpo.run import train_in_run_dir
    from grpolab.grpo.setup import build_setup

    agent = ["model.name_or_path=builtin:tiny-chat", "model.hidden_size=32", "model.num_layers=2",
             "model.num_heads=2", "environment.name=grpolab.agents.builtin:GuessNumber",
             "environment.kwargs={n: 9, max_turns: 3}", "data.source=builtin:seeds", "rewards=[]",
             "rollout.max_turns=3", "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=4",
             "train.minibatch_size=8", "train.microbatch_size=4", "train.steps=2", "run.threads=1",
             "run.progress=false", "run.tensorboard=false", "model.dtype=float32"]
    rows = {}
    for name, extra in (("local", []), ("env_workers", ["rollout.env_workers=2", "rollout.env_timeout_s=30"])):
        s = build_setup(C.from_preset("grpo", agent + extra))
        assert train_in_run_dir(s, tmp_path / name) == 0
        made = getattr(s.data.agent.make_environment, "made", None)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "tokens_per_s/", "mfu"))}
                      for x in lines]
    assert made == 2 * 2 * 4  # the last run's environments were made on its env workers: steps x P x G
    assert len(rows["local"]) == 2 and rows["env_workers"] == rows["local"]
    assert rows["local"][0]["episode/env_errors"] == 0
