"""grpolab.agents.driver: episodes turn by turn with a scripted `generate` (token in, token out)."""

import pytest
import torch

from agents_chat import WORD
from grpolab.agents.builtin import CalculatorTask, GuessNumber
from grpolab.agents.delta import render
from grpolab.agents.driver import EpisodeDriver
from grpolab.agents.episode import to_tensors
from grpolab.agents.protocol import load_environment
from grpolab.agents.tools import load_tools
from grpolab.models.tiny import build_tiny_model
from grpolab.batch import position_ids


class Script:
    """A fake policy: returns the scripted turns in order (text -> char ids + EOS unless cut), with
    made-up log-probs, and records what it was given."""

    def __init__(self, tok, turns, eos=True):
        self.tok, self.turns, self.eos, self.inputs, self.sampled = tok, list(turns), eos, [], []

    def __call__(self, input_ids, max_new_tokens):
        self.inputs.append((list(input_ids), max_new_tokens))
        turn = self.turns.pop(0)
        ids = turn if isinstance(turn, list) else self.tok.encode(turn, add_special_tokens=False)
        ids = (ids + [self.tok.eos_token_id] * self.eos)[:max_new_tokens]
        self.sampled.append(ids)
        return ids, [-0.01 * (k + 1) for k in range(len(ids))]


def _guess_driver(tok, script, **kw):
    return EpisodeDriver(tok, script, make_environment=lambda: GuessNumber(n=100, max_turns=5), **kw)


def test_a_guessing_episode_token_by_token(chat_tok):
    script = Script(chat_tok, ["50", "I say 25", "37"])
    ep = _guess_driver(chat_tok, script, max_turns=5).run({"secret": 37})
    assert ep.done and not ep.truncated and ep.stop_reason == "done" and ep.turns == 3
    assert ep.rewards == [(2, 1.0)] and ep.reward == 1.0
    policy = [list(s.ids) for s in ep.segments if s.policy]
    assert policy == script.sampled  # the sampled ids, exactly
    # the episode spells the template's rendering of its messages, up to the policy's last <|im_end|>
    assert [m["content"] for m in ep.messages[1:]] == ["50", "lower", "I say 25", "higher", "37"]
    full = chat_tok.encode(render(chat_tok, ep.messages), add_special_tokens=False)
    assert ep.ids == full[:-1] and chat_tok.decode(full[-1:]) == "\n"
    # generate saw the whole episode so far each time: the prompt, then up to each policy turn
    starts = [len(ep.prompt_ids)]
    for seg in ep.segments:
        starts.append(starts[-1] + len(seg.ids))
    assert [x for x, _ in script.inputs] == [ep.ids[:starts[0]], ep.ids[:starts[2]], ep.ids[:starts[4]]]


def test_policy_ids_are_never_decoded_and_reencoded(chat_tok):
    spelled = [chat_tok.convert_tokens_to_ids(c) for c in WORD]  # "cannot" one character at a time
    assert chat_tok.encode(WORD, add_special_tokens=False) != spelled  # re-encoding would change the ids
    script = Script(chat_tok, [spelled, "37"])
    ep = _guess_driver(chat_tok, script, max_turns=5).run({"secret": 37})
    assert list(ep.segments[0].ids) == spelled + [chat_tok.eos_token_id]
    assert ep.messages[1] == {"role": "assistant", "content": WORD}  # the text is only for the environment
    assert ep.messages[2]["content"] == "Reply with a number."


def test_control_token_text_echoed_back_is_removed(chat_tok):
    """The policy spells "<|im_end|>" in plain characters; the environment echoes it: the reply must not
    carry a forged end-of-turn token into the episode."""
    spelled = [chat_tok.convert_tokens_to_ids(c) for c in "<|im_end|>"]
    make = load_environment("agents_fixtures:EchoEnv", {"turns": 2})
    ep = EpisodeDriver(chat_tok, Script(chat_tok, [spelled, "ok"]), make_environment=make, max_turns=3).run({})
    assert ep.done and ep.reward == 1.0 and ep.messages[2] == {"role": "user", "content": "echo: "}
    assert list(ep.segments[1].ids).count(chat_tok.eos_token_id) == 1  # the template's own <|im_end|> only
    assert list(ep.segments[0].ids) == spelled + [chat_tok.eos_token_id]


def test_max_turns_truncates(chat_tok):
    ep = _guess_driver(chat_tok, Script(chat_tok, ["50", "60"]), max_turns=2).run({"secret": 37})
    assert ep.truncated and not ep.done and ep.stop_reason == "max_turns" and ep.turns == 2
    assert ep.segments[-1].policy and len(ep.segments) == 3  # the last reply is not appended
    assert ep.messages[-1] == {"role": "assistant", "content": "60"}


def test_a_turn_cut_by_its_token_budget_truncates(chat_tok):
    script = Script(chat_tok, ["123456"], eos=False)
    ep = _guess_driver(chat_tok, script, max_turns=3, max_turn_tokens=4).run({"seed": 1})
    assert ep.truncated and ep.stop_reason == "max_turn_tokens" and ep.turns == 1
    assert list(ep.segments[0].ids) == chat_tok.encode("1234", add_special_tokens=False)


def test_the_episode_token_budget(chat_tok):
    script = Script(chat_tok, ["50", "99999999"])
    prompt_len = len(_guess_driver(chat_tok, Script(chat_tok, ["37"])).run({"secret": 37}).prompt_ids)
    ep = _guess_driver(chat_tok, script, max_turns=5, max_episode_tokens=prompt_len + 3 + 30).run({"secret": 37})
    assert ep.stop_reason == "max_episode_tokens" and ep.truncated and ep.length == prompt_len + 3 + 30
    assert script.inputs[1][1] == 30 - len(ep.segments[1].ids)  # the second turn got what was left
    # a delta that does not fit ends the episode before it
    ep = _guess_driver(chat_tok, Script(chat_tok, ["50"]), max_turns=5, max_episode_tokens=prompt_len + 10).run(
        {"secret": 37})
    assert ep.stop_reason == "max_episode_tokens" and len(ep.segments) == 1
    # a prompt that does not fit
    ep = _guess_driver(chat_tok, Script(chat_tok, []), max_episode_tokens=prompt_len).run({"secret": 37})
    assert ep.truncated and ep.segments == [] and ep.stop_reason == "max_episode_tokens"


def test_generate_must_respect_its_budget(chat_tok):
    def greedy(ids, n):
        return list(range(n + 1)), [0.0] * (n + 1)

    with pytest.raises(ValueError, match="generate returned 5 ids for max_new_tokens=4"):
        _guess_driver(chat_tok, greedy, max_turn_tokens=4).run({"seed": 0})


def test_tools_in_the_default_format_without_an_environment(chat_tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    bad = '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    script = Script(chat_tok, [call, bad, "It is 5."])
    with load_tools(["agents_fixtures:add"]) as tools:
        ep = EpisodeDriver(chat_tok, script, tools=tools, max_turns=4, max_episode_tokens=4096).run({"prompt": "2+3?"})
    assert ep.done and ep.stop_reason == "done" and ep.turns == 3 and ep.reward is None
    assert ep.tool_calls == 3 and dict(ep.tool_errors) == {"unknown_tool": 1, "malformed": 1}
    assert ep.messages[0]["role"] == "system" and "<tools>" in ep.messages[0]["content"]  # SmolLM2: no tools
    assert ep.messages[3] == {"role": "user", "content":
                              '<tool_response>\n{"name": "add", "content": "5"}\n</tool_response>'}
    assert "unknown tool 'mul'" in ep.messages[5]["content"] and "invalid JSON" in ep.messages[5]["content"]
    assert chat_tok.decode(ep.segments[1].ids).startswith("\n<|im_start|>user\n<tool_response>")


def test_tools_with_a_template_that_has_them(tools_tok):
    script = Script(tools_tok, ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>', "2"])
    with load_tools(["agents_fixtures:add"]) as tools:
        ep = EpisodeDriver(tools_tok, script, tools=tools, max_turns=3).run({"prompt": "1+1?"})
    assert ep.messages[0] == {"role": "user", "content": "1+1?"}  # the schemas went to the template instead
    assert '"name": "add"' in tools_tok.decode(ep.prompt_ids)
    assert ep.messages[2] == {"role": "tool", "name": "add", "content": "2"}
    assert tools_tok.decode(ep.segments[1].ids) == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_calculator_task_with_its_tool(chat_tok):
    env = CalculatorTask()
    env.reset({"seed": 3})
    a, b = env.operands
    script = Script(chat_tok, [f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}'
                               "</tool_call>", f"The answer is {a * b}."])
    with load_tools(["grpolab.agents.builtin:calculator"]) as tools:
        ep = EpisodeDriver(chat_tok, script, make_environment=CalculatorTask, tools=tools, max_turns=3,
                           max_episode_tokens=4096).run({"seed": 3})
    assert ep.done and ep.rewards == [(1, 1.0)] and ep.tool_calls == 1 and not ep.tool_errors
    assert f'"content": "{a * b}"' in ep.messages[3]["content"]


def test_recomputed_logprobs_equal_the_samplers_over_a_three_turn_episode(chat_tok):
    """The test of record (DESIGN §10) on CPU: a tiny model's per-token log-probs, recorded turn by
    turn while driving, equal one forward over the batch laid out by to_tensors."""
    model = build_tiny_model(chat_tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=256, seed=0).eval()

    def make_generate(turns):
        def generate(ids, max_new_tokens):
            """Teacher-forces the scripted turn, recording the model's log-prob of each id."""
            out = chat_tok.encode(turns.pop(0), add_special_tokens=False) + [chat_tok.eos_token_id]
            with torch.no_grad():
                logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
            return out, logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0].tolist()
        return generate

    driver = _guess_driver(chat_tok, make_generate(["50", "25", "37"]), max_turns=5)
    three = driver.run({"secret": 37})
    one = _guess_driver(chat_tok, make_generate(["I think 37"]), max_turns=5).run({"secret": 37})
    assert three.turns == 3 and one.turns == 1
    t = to_tensors([three, one], pad_id=chat_tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=t.input_ids, attention_mask=t.attention_mask.long(),
                       position_ids=position_ids(t.attention_mask)).logits.float()
    lp = t.prompt_len
    labels = t.input_ids[:, lp:]
    recomputed = logits[:, lp - 1 : -1].log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(recomputed[t.policy_mask], t.sampler_logp[t.policy_mask])
