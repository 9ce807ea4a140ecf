"""grpolab.grpo.setup helpers: the AdamW every trainer builds."""

import torch

from grpolab.algo.optim import adamw


def _params(seed: int, device: str = "cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in ((7, 5), (5,), (3, 4, 2))]


def test_adamw_is_fused_on_cpu_and_matches_the_foreach_update():
    fused_p, ref_p = _params(0), _params(0)
    opt = adamw(fused_p, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    assert opt.param_groups[0]["fused"] is True
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for a, b in zip(fused_p, ref_p):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(fused_p, ref_p):
        torch.testing.assert_close(a, b)
    assert not torch.equal(fused_p[0], _params(0)[0])  # the parameters did move


def test_adamw_falls_back_where_no_fused_kernel_exists():
    opt = adamw(_params(0, device="meta"), lr=1e-3)
    assert not opt.param_groups[0]["fused"]


def test_model_compile_compiles_the_reference_and_old_logprob_forwards_not_the_checkpointed_copy():
    from torch._dynamo.eval_frame import OptimizedModule

    from grpolab import config as C
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
    from grpolab.forward import LogProbForward
    from grpolab.forward.compiled import CompiledBlocks, training_module
    from grpolab.grpo.setup import reference_factory

    tok = build_char_tokenizer()
    policy = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    wrappers = {"false": torch.nn.Module, "true": CompiledBlocks, "true model": OptimizedModule}
    for setting, wrapper in wrappers.items():
        compile_, *scope = setting.split()
        cfg = C.from_preset("grpo", [f"model.compile={compile_}", "loss.kl_coef=0.04",
                                     f"model.compile_scope={scope[0] if scope else 'blocks'}"])
        factory = reference_factory(cfg, policy, LogProbForward.from_config(cfg, None))
        with factory() as ref:
            assert isinstance(ref, wrapper)  # wrapping is lazy: nothing compiles here
            assert (ref is factory.model) == (compile_ == "false")
            assert {id(p) for p in ref.parameters()} == {id(p) for p in factory.model.parameters()}
        assert not isinstance(factory.model, (OptimizedModule, CompiledBlocks))  # checkpoints save the plain copy
        assert not any(p.requires_grad for p in factory.model.parameters())
        assert isinstance(training_module(policy, compile_ == "true", scope=(scope or ["blocks"])[0]), wrapper)


def test_train_keep_freed_memory_switches_the_heap_policy_at_setup(monkeypatch):
    import grpolab.grpo.setup as S
    from grpolab import config as C
    from grpolab.data.arith import ArithTask
    from grpolab.data.stream import ArithStream
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    calls = []
    monkeypatch.setattr(S, "keep_freed_memory", lambda: calls.append(1) or True)  # the real one is process-wide
    tok = build_char_tokenizer()
    for keep in (False, True):
        cfg = C.from_preset("grpo", [f"train.keep_freed_memory={str(keep).lower()}", "run.tensorboard=false",
                                     "run.progress=false"])
        policy = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
        S.build_setup(cfg, policy=policy, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
        assert len(calls) == int(keep)


def test_padding_free_microbatches_carry_equal_tokens_padded_ones_similar_lengths():
    import grpolab.grpo.setup as S
    from grpolab import config as C
    from grpolab.data.arith import ArithTask
    from grpolab.data.stream import ArithStream
    from grpolab.forward.buckets import balanced_buckets, group_buckets, length_buckets
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    for padding_free in (False, True):
        for shared in (False, True):
            cfg = C.from_preset("grpo", [f"model.padding_free={str(padding_free).lower()}", "run.tensorboard=false",
                                         f"model.shared_prompt={str(shared).lower()}", "run.progress=false"])
            policy = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
            s = S.build_setup(cfg, policy=policy, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
            chunks = s.optim.forward.layout.chunks
            if padding_free and shared:
                assert chunks.func is balanced_buckets and chunks.keywords == {"whole_groups": True}
            elif padding_free:
                assert chunks is balanced_buckets
            else:
                assert chunks is (group_buckets if shared else length_buckets)


def test_padding_free_and_shared_prompt_switch_the_attention_before_the_first_rollout():
    """A compiled decode step traced before the switch would compile again at the next rollout; a
    policy without SDPA attention is refused at setup, naming the option."""
    import pytest

    import grpolab.grpo.setup as S
    from grpolab import config as C
    from grpolab.data.arith import ArithTask
    from grpolab.data.stream import ArithStream
    from grpolab.forward.attention import FAST_CPU_ATTENTION
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    for option in ("", "model.padding_free", "model.shared_prompt"):
        switches = [f"{name}={str(name == option).lower()}" for name in ("model.padding_free", "model.shared_prompt")]
        cfg = C.from_preset("grpo", ["run.tensorboard=false", "run.progress=false", *switches])  # not auto: host-free
        policy = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
        assert policy.config._attn_implementation == "sdpa"
        S.build_setup(cfg, policy=policy, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
        assert (policy.config._attn_implementation == FAST_CPU_ATTENTION) == bool(option)
        if option:
            policy.set_attn_implementation("eager")
            with pytest.raises(ValueError, match=option.replace(".", r"\.")):
                S.build_setup(cfg, policy=policy, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))


def test_the_engine_gets_the_rollout_settings():
    import grpolab.grpo.setup as S
    from grpolab import config as C
    from grpolab.data.arith import ArithTask
    from grpolab.data.stream import ArithStream
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    for packed in (False, True):
        cfg = C.from_preset("grpo", [f"rollout.packed_weights={str(packed).lower()}", "rollout.max_new_tokens=7",
                                     "model.dtype=float32", "run.tensorboard=false", "run.progress=false"])
        policy = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=0)
        s = S.build_setup(cfg, policy=policy, tokenizer=tok, prompts=ArithStream(ArithTask(), seed=0))
        assert (s.data.engine.packed_weights, s.data.engine.max_new_tokens, s.data.engine.compile) == (packed, 7, False)
