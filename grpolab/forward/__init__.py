"""The log-prob forward: batch layouts, grpolab's attention, and the `LogProbForward` object."""

from grpolab.forward.layouts import LAYOUTS, Layout, completion_logprobs, layout_for
from grpolab.forward.logprob import LogProbForward, batched_logprobs

__all__ = ["LAYOUTS", "Layout", "LogProbForward", "batched_logprobs", "completion_logprobs", "layout_for"]
