"""Runs one episode turn by turn, model-agnostic: the model is a `generate` callable.

    driver = EpisodeDriver(tokenizer, generate, make_environment=load_environment(spec, kwargs),
                           tools=load_tools(specs), max_turns=4, max_episode_tokens=1024)
    episode = driver.run(item)

`generate(input_ids, max_new_tokens) -> (ids, logps)`: input_ids is the whole episode so far
(a fresh list of ints: prompt, earlier turns, the last environment delta; a KV-cached engine
appends only what is new since its last call); it returns the sampled ids of ONE policy turn, at
most max_new_tokens of them, ending with the end-of-turn token unless cut, and the sampler's
log-prob of each. The driver keeps those ids as they are (token in, token out); it decodes them
only to give the environment the turn's text.

One turn: the policy samples; a turn that does not end with the end-of-turn token was cut by a
token budget and ends the episode (truncated). Otherwise the turn's text goes to the tools when it
holds <tool_call> blocks and tools are configured (the results are the environment's reply; no
reward, not done), else to the environment's `step` (without an environment: the episode is done,
its reward left to the reward functions). An environment that raises (in its constructor, reset or
step) or breaks the protocol ends the episode: stop_reason "env_error", the error in
Episode.env_error (the trainer applies train.on_reward_error). Done -> the episode ends; max_turns policy turns reached
-> ends, truncated; else the reply is appended as the template's delta (delta.py) and the next
turn starts, unless the delta does not fit max_episode_tokens (ends, truncated). The final
environment reply of an ending episode is not appended: nothing is generated after it.

Control-token text (e.g. the characters "<|im_end|>") is removed from every reply's content before
it is encoded: tool results and environment replies may echo the model's words, and such text would
otherwise be encoded as the control token itself (a forged end of turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from grpolab.agents.delta import env_delta_ids, prompt_ids, strip_control_text
from grpolab.agents.episode import Episode
from grpolab.agents.protocol import Environment, StepResult, as_step_result, check_messages, describe_error
from grpolab.agents.toolcall import parse_tool_calls, template_supports_tools, tool_result_messages, with_tool_prompt
from grpolab.agents.tools import ToolBox, call_tool

Generate = Callable[[list[int], int], tuple[Sequence[int], Sequence[float]]]
"""(episode ids so far, max new tokens) -> (one turn's sampled ids [n], their log-probs [n])."""


@dataclass
class EpisodeDriver:
    """Drives episodes with one tokenizer, model callable, environment kind and tool set.

    make_environment: a zero-argument factory (`protocol.load_environment`), called once per
    episode; None: the item's own messages (item["messages"], or item["prompt"] as one user message;
    with a tokenizer that has no chat template and no tools, item["prompt"] is the prompt text as it
    is, for one-turn episodes of a plain completion model) and tools only. tools: a ToolBox or None. max_turns: policy turns per episode. max_episode_tokens:
    prompt and body together. max_turn_tokens: per policy turn (None: what the episode has left).
    end_of_turn: the text of the policy's end-of-turn token (default: tokenizer.eos_token).
    """

    tokenizer: Any
    generate: Generate
    make_environment: Callable[[], Environment] | None = None
    tools: ToolBox | None = None
    max_turns: int = 1
    max_episode_tokens: int = 1024
    max_turn_tokens: int | None = None
    end_of_turn: str | None = None

    def __post_init__(self):
        if self.max_turns < 1 or self.max_episode_tokens < 2 or (self.max_turn_tokens or 1) < 1:
            raise ValueError(f"EpisodeDriver: max_turns ({self.max_turns}), max_episode_tokens "
                             f"({self.max_episode_tokens}, at least 2) and max_turn_tokens "
                             f"({self.max_turn_tokens}) must be positive")
        self.end_of_turn = self.end_of_turn or self.tokenizer.eos_token
        self.end_id = self.tokenizer.convert_tokens_to_ids(self.end_of_turn)
        if self.end_of_turn is None or self.end_id is None or self.end_id == self.tokenizer.unk_token_id:
            raise ValueError(f"EpisodeDriver: end-of-turn token {self.end_of_turn!r} is not one token of the tokenizer")
        self.native_tools = bool(self.tools) and template_supports_tools(self.tokenizer)
        self.template_tools = self.tools.schemas if self.native_tools else None

    def run(self, item: Any) -> Episode:
        """One episode for `item` (see the module docstring); the environment is made fresh for it."""
        env = None
        try:
            env = self.make_environment() if self.make_environment is not None else None
            messages = self._opening(env, item)
        except Exception as e:  # noqa: BLE001 - user code: recorded, the trainer applies train.on_reward_error
            if env is None and self.make_environment is None:
                raise  # the item itself is unusable: not the environment's error
            ep = Episode([self.end_id], env_error=describe_error(e, type(env).__name__ if env else "environment"))
            return ep.finish("env_error", truncated=False)
        ep = Episode(self._prompt_ids(messages, item if env is None else None), messages=messages)
        if ep.length >= self.max_episode_tokens:
            return ep.finish("max_episode_tokens", truncated=True)
        while True:
            budget = self.max_episode_tokens - ep.length
            ids = self._policy_turn(ep, min(budget, self.max_turn_tokens or budget))
            if ids[-1] != self.end_id:
                return ep.finish("max_episode_tokens" if len(ids) == budget else "max_turn_tokens", truncated=True)
            text = self.tokenizer.decode(ids[:-1], skip_special_tokens=True)  # for the environment only
            ep.messages.append({"role": "assistant", "content": text})
            reply = self._respond(env, ep, text)
            if reply is None:
                return ep.finish("env_error", truncated=False)
            if reply.reward is not None:
                ep.rewards.append((ep.turns - 1, reply.reward))
            if reply.done:
                return ep.finish("done", truncated=False)
            if ep.turns >= self.max_turns:
                return ep.finish("max_turns", truncated=True)
            new = [{**m, "content": strip_control_text(self.tokenizer, m["content"])} for m in reply.messages]
            delta = env_delta_ids(self.tokenizer, ep.messages, new, self.template_tools, self.end_of_turn)
            if ep.length + len(delta) >= self.max_episode_tokens:  # no room left for a policy token
                return ep.finish("max_episode_tokens", truncated=True)
            ep.add_env(delta)
            ep.messages.extend(new)

    def _opening(self, env: Environment | None, item: Any) -> list[dict[str, Any]]:
        """The opening messages: the environment's reset, else the item's; plus the default tool prompt."""
        if env is not None:
            messages = check_messages(env.reset(item), f"{type(env).__name__}.reset")
        elif isinstance(item, dict) and "messages" in item:
            messages = check_messages(item["messages"], "item['messages']")
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            messages = [{"role": "user", "content": item["prompt"]}]
        else:
            raise ValueError("EpisodeDriver: without an environment, an item needs 'messages' or a 'prompt' string")
        if self.tools and not self.native_tools:
            messages = with_tool_prompt(messages, self.tools.schemas)
        return messages

    def _prompt_ids(self, messages: list[dict[str, Any]], item: Any) -> list[int]:
        """The opening rendered by the chat template; a tokenizer without one takes the item's
        "prompt" as the text itself (a plain completion model: one turn, nothing appended after it)."""
        if getattr(self.tokenizer, "chat_template", None) is None and isinstance(item, dict) \
                and isinstance(item.get("prompt"), str) and not self.tools:
            return list(self.tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
        return prompt_ids(self.tokenizer, messages, self.template_tools)

    def _policy_turn(self, ep: Episode, max_new_tokens: int) -> list[int]:
        """Samples one turn (at most max_new_tokens ids), records it, returns its ids."""
        ids, logps = self.generate(ep.ids, max_new_tokens)
        ids, logps = [int(i) for i in ids], [float(x) for x in logps]
        if not 1 <= len(ids) <= max_new_tokens:
            raise ValueError(f"EpisodeDriver: generate returned {len(ids)} ids for max_new_tokens={max_new_tokens}")
        ep.add_policy(ids, logps)
        return ids

    def _respond(self, env: Environment | None, ep: Episode, text: str) -> StepResult | None:
        """The reply to a policy turn: tool results when it calls tools, else the environment's step;
        None when the step raised or broke the protocol (recorded in ep.env_error)."""
        calls = parse_tool_calls(text) if self.tools else []
        if calls:
            outcomes = [call_tool(self.tools, c) for c in calls]
            ep.tool_calls += len(calls)
            ep.tool_errors.update(o.error for o in outcomes if o.error)
            return StepResult(tool_result_messages(outcomes, self.native_tools), None, False)
        if env is None:
            return StepResult([], None, True)
        try:
            return as_step_result(env.step({"role": "assistant", "content": text}), type(env).__name__)
        except Exception as e:  # noqa: BLE001 - user code: recorded, the trainer applies train.on_reward_error
            ep.env_error = describe_error(e, type(env).__name__)
            return None
