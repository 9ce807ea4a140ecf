"""grpolab.agents.episode: the token record of an episode, and the batch layout (== today's Rollout for one turn)."""

import torch

from grpolab.agents.driver import EpisodeDriver
from grpolab.agents.episode import Episode, to_tensors
from grpolab.models.tiny import build_tiny_model
from grpolab.rollout.hf import HFEngine, pad_id


def _two_turns() -> Episode:
    ep = Episode([5, 6, 7])
    ep.add_policy([10, 11, 3], [-0.1, -0.2, -0.3])
    ep.add_env([20, 21])
    ep.add_policy([12, 3], [-0.4, -0.5])
    return ep


def test_episode_record():
    ep = _two_turns()
    assert ep.turns == 2 and ep.length == 10
    assert ep.body_ids == [10, 11, 3, 20, 21, 12, 3] and ep.ids == [5, 6, 7] + ep.body_ids
    assert ep.policy_mask == [True, True, True, False, False, True, True]
    assert ep.sampler_logp == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert ep.turn_index == [0, 0, 0, -1, -1, 1, 1]
    assert ep.reward is None
    ep.rewards += [(0, 0.5), (1, 1.0)]
    assert ep.reward == 1.5
    assert ep.finish("done", truncated=False).done and not ep.truncated


def test_to_tensors_left_pads_prompts_and_right_pads_bodies():
    short = Episode([8])
    short.add_policy([13], [-1.0])
    short.finish("max_turn_tokens", truncated=True)
    t = to_tensors([_two_turns(), short], pad_id=0)
    assert t.prompt_len == 3 and t.input_ids.shape == (2, 10) and t.policy_mask.shape == (2, 7)
    assert t.input_ids.tolist() == [[5, 6, 7, 10, 11, 3, 20, 21, 12, 3], [0, 0, 8, 13, 0, 0, 0, 0, 0, 0]]
    assert t.attention_mask.tolist() == [[True] * 10, [False, False, True, True] + [False] * 6]
    assert t.policy_mask.tolist() == [[True, True, True, False, False, True, True], [True] + [False] * 6]
    torch.testing.assert_close(t.sampler_logp, torch.tensor([[-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5], [-1.0] + [0.0] * 6]))
    assert t.turn_index.tolist() == [[0, 0, 0, -1, -1, 1, 1], [0] + [-1] * 6]
    assert t.truncated.tolist() == [False, True]
    assert t.input_ids.dtype == torch.long and t.sampler_logp.dtype == torch.float32


class _OneStep:
    def reset(self, item):
        return [{"role": "system", "content": "S"}, {"role": "user", "content": item["q"]}]

    def step(self, message):
        return [], 1.0, True


def test_a_single_turn_episode_is_todays_rollout_layout(chat_tok):
    """The HF engine samples completions; the same ids, driven as one-turn episodes, lay out identically."""
    model = build_tiny_model(chat_tok, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0).eval()
    eos = chat_tok.eos_token_id
    head = torch.nn.Linear(32, len(chat_tok), bias=True)  # an EOS bias: some rows finish, some are cut
    head.weight = model.get_input_embeddings().weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[eos] = 3.5
    model.lm_head = head
    items = [{"q": "2+2?"}, {"q": "12+345?"}]
    prompts = [chat_tok.apply_chat_template(_OneStep().reset(it), add_generation_prompt=True, tokenize=False)
               for it in items]
    engine = HFEngine(chat_tok, max_new_tokens=6)
    ro = engine.generate_with(model, prompts, group_size=3, generator=torch.Generator().manual_seed(0))
    assert ro.truncated.any() and not ro.truncated.all()  # both cases are covered
    rows = iter(range(ro.num_sequences))

    def replay(input_ids, max_new_tokens):
        """Returns row r's completion through its first EOS, as the engine sampled it."""
        r = next(rows)
        keep = ro.loss_mask[r]
        return ro.completion_ids[r][keep].tolist(), ro.sampler_logp[r][keep].tolist()

    driver = EpisodeDriver(chat_tok, replay, make_environment=_OneStep, max_turn_tokens=6)
    episodes = [driver.run(it) for it in items for _ in range(3)]
    t = to_tensors(episodes, pad_id(chat_tok))
    ref = ro.select(torch.arange(ro.num_sequences))  # trimmed like a microbatch: no all-pad columns
    assert t.prompt_len == ref.prompt_len
    assert torch.equal(t.input_ids, ref.input_ids)
    assert torch.equal(t.attention_mask, ref.attention_mask)
    assert torch.equal(t.policy_mask, ref.loss_mask)
    assert torch.equal(t.sampler_logp, ref.sampler_logp)
    assert torch.equal(t.truncated, ref.truncated)
    assert [e.stop_reason for e in episodes] == ["max_turn_tokens" if x else "done" for x in ro.truncated.tolist()]
