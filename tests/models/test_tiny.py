import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.models.tiny import (
    BASE_ALPHABET,
    build_char_tokenizer,
    build_tiny_model,
    count_params,
    encode_checked,
)

SAMPLES = ["12+7=", "19", "cannot", "007/00=", "(3*4)-?= ab", "-5"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_tokenizer_special_ids_and_padding_side(tok):
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<pad>", "<eos>", "<bos>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    assert len(tok) == 3 + len(BASE_ALPHABET) + 1  # + the whole-word token "cannot"


def test_one_id_per_char_no_specials(tok):
    ids = tok("12+7=")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "12+7="]
    assert len(ids) == 5 and min(ids) >= 3  # no special ids added
    assert encode_checked(tok, "12+7=") == ids


def test_decode_round_trip_and_skip_specials(tok):
    for s in SAMPLES:
        ids = encode_checked(tok, s)
        assert tok.decode(ids) == s
        assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == s


def test_left_padding(tok):
    batch = tok(["1+2=", "10+20="], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [0, 0]
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]


def test_unknown_char_raises_naming_it(tok):
    with pytest.raises(ValueError, match=r"'#' at position 2"):
        encode_checked(tok, "12#7")
    with pytest.raises(ValueError, match="'A'"):
        encode_checked(tok, "A")
    with pytest.raises(Exception):  # the backend itself refuses too: nothing maps silently to unk
        tok("12#7")


def test_extra_chars(tok):
    tok2 = build_char_tokenizer(extra_chars="#A+")  # "+" already present: not duplicated
    assert len(tok2) == len(tok) + 2
    assert tok2.decode(encode_checked(tok2, "1#A")) == "1#A"
    assert tok2("12+7=")["input_ids"] == tok("12+7=")["input_ids"]  # base ids unchanged
    with pytest.raises(ValueError, match="line breaks"):
        build_char_tokenizer(extra_chars="\n")


def test_tokenizer_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok2.pad_token_id, tok2.eos_token_id, tok2.bos_token_id, tok2.padding_side) == (0, 1, 2, "left")
    for s in SAMPLES:
        assert tok2(s)["input_ids"] == tok(s)["input_ids"]
        assert tok2.decode(tok(s)["input_ids"]) == s


def test_model_config(tok):
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert cfg.vocab_size == len(tok)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == 1 and model.generation_config.pad_token_id == 0
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert cfg.intermediate_size == 96
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert cfg._attn_implementation in ("sdpa", "eager")


def test_count_params_counts_tied_weights_once(tok):
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2)
    v, h = len(tok), 32
    per_layer = 4 * h * h + 3 * h  # q,k,v,o (kv heads = heads) + q/k/v biases (Qwen2)
    per_layer += 3 * h * 3 * h + 2 * h  # SwiGLU MLP (intermediate 3h) + 2 RMSNorms
    assert count_params(model) == v * h + per_layer + h  # embeddings (tied) + layer + final norm
    model.model.embed_tokens.weight.requires_grad_(False)
    assert count_params(model, trainable_only=True) == per_layer + h


def test_seeding_is_deterministic_and_leaves_global_rng(tok):
    state = torch.random.get_rng_state()
    a = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=3)
    b = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=3)
    c = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_model_save_load_same_logits(tok, tmp_path):
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    ids = torch.tensor([encode_checked(tok2, "12+7=19")])
    with torch.no_grad():
        torch.testing.assert_close(model2(ids).logits, model(ids).logits)
    assert model2.lm_head.weight.data_ptr() == model2.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_forward_and_greedy_generate(tok, arch):
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, arch=arch).eval()
    batch = tok(["1+2=", "10+20="], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert logits.shape == (2, 6, len(tok))
    assert torch.isfinite(logits).all()
    assert out.shape[0] == 2 and 6 < out.shape[1] <= 9


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tok, arch="gpt2")
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_model(tok, hidden_size=30, num_heads=4)


def test_saved_model_folder_reloads_the_same_tokenizer(tmp_path):
    # AutoTokenizer would pick Qwen2Tokenizer from config.json and change the ids.
    from grpolab.models.loading import load_model, load_tokenizer

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, num_heads=2)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    text = "cannot 12+7= ab"
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert load_tokenizer(tmp_path)(text, add_special_tokens=False)["input_ids"] == want
    _, tok2 = load_model(str(tmp_path))
    assert tok2(text, add_special_tokens=False)["input_ids"] == want
