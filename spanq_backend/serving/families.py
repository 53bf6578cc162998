"""The model families spanq is checked on, and a tiny random-weight model of each, built locally.

Each `Family` names a transformers architecture and the config features that matter to span reuse (its RoPE,
QK-norm, fused QKV, sliding-window layers, attention sinks). `tiny_family_path("qwen3")` builds a 4-layer fp32
model of that family once (random weights from a fixed seed, SmolLM2's tokenizer with a chat template of the
family's shape) under `cache_dir()/models/`: the engine loads it like any model folder, the HF reference
(`benchmarks.hf_span`) reads the same weights, so every family is checked end to end with no download.
The model names `tiny-<family>` resolve to these folders (`models.resolve_model`).

The README's support table is `SUPPORT` rendered; each row names the test that proves it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "Family",
    "UnsupportedModelError",
    "check_loadable",
    "check_spans",
    "family_line",
    "family_of_config",
    "tiny_family_path",
]

# Chat templates of each family's shape (the roles' markers as the family writes them), over SmolLM2's vocabulary:
# what matters to spans is where each message's text sits, which these reproduce.
_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}"
    "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]{% else %}{{ m['content'] }}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)
_PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Gemma has no system turn: the system text opens the first user turn, as Gemma's own template does.
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set first = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set first.system = m['content'] + '\n\n' %}{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.index0 == 1 or (loop.first and m['role'] != 'system') %}{{ first.system }}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """A model family as spanq checks it: its transformers classes, a tiny config, and what to say about it."""

    name: str
    config_class: str  # transformers config class
    model_class: str  # transformers causal-LM class
    features: str  # what in it matters to span reuse
    config: dict[str, Any] = field(default_factory=dict)  # over the tiny shape below
    chat_template: str | None = None  # None: SmolLM2's (ChatML, Qwen's shape)
    spans: str = "exact"  # "exact", or why it is refused
    test: str = "tests/backend/test_families.py"


def _rope(kind: str = "default", theta: float = 1e4, **more: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": theta, **more}}


_WINDOW_RULE = "exact while max_model_len <= the sliding window; refused beyond it"

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama3", "LlamaConfig", "LlamaForCausalLM",
               "Llama 2/3.x, SmolLM2: plain, linear or llama3-scaled RoPE",
               _rope("llama3", 5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=1024), _LLAMA3_TEMPLATE),
        Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2.5: QKV bias", _rope(theta=1e6)),
        Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3: QK-norm before RoPE", _rope(theta=1e6)),
        Family("qwen3-yarn", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3 with YaRN (factor 4): scaled keys",
               _rope("yarn", 1e6, factor=4.0, original_max_position_embeddings=2048)),
        Family("mistral", "MistralConfig", "MistralForCausalLM", "Mistral: [INST] template",
               {"sliding_window": None, **_rope(theta=1e6)}, _MISTRAL_TEMPLATE),
        Family("phi3", "Phi3Config", "Phi3ForCausalLM", "Phi-3/3.5: fused QKV, LongRoPE",
               {"original_max_position_embeddings": 4096,
                **_rope("longrope", 1e4, short_factor=[1.0 + 0.05 * i for i in range(32)],
                        long_factor=[1.5 + 0.1 * i for i in range(32)])}, _PHI3_TEMPLATE),
        Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
               "Gemma 2: alternating sliding-window layers, logit soft-capping",
               {"sliding_window": 4096, "query_pre_attn_scalar": 64, **_rope()}, _GEMMA_TEMPLATE, _WINDOW_RULE),
        Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               "Gemma 3: QK-norm, local and global RoPE bases per layer, sliding-window layers",
               {"sliding_window": 4096, "query_pre_attn_scalar": 64,
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, _GEMMA_TEMPLATE, _WINDOW_RULE),
        Family("gpt-oss", "GptOssConfig", "GptOssForCausalLM",
               "GPT-OSS: YaRN, attention sinks, mixture of experts, 128-token sliding window",
               {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                **_rope("yarn", 15e4, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                        original_max_position_embeddings=256)},
               spans="refused: vLLM 0.32's CPU GPT-OSS does not agree with the HF reference even without spans "
               "(logprobs apart by more than 10 nats on the tiny model), so spans cannot be checked on it here; its "
               "128-token sliding window would also refuse any longer context"),
        Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", "OLMo 2: norm after attention and MLP",
               _rope(theta=5e5),
               spans="refused: vLLM 0.32 runs it through its Transformers backend, whose rotary embedding spanq "
               "cannot move"),
    )
}


def tiny_family_path(family: str, seed: int = 0) -> Path:
    """A tiny random model of `family` (4 layers, hidden 256, GQA 4/2 heads, head_dim 64, fp32), built once."""
    from spanq_backend.cache import cache_dir
    from spanq_backend.serving.model_folders import materialize

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: expected one of {', '.join(FAMILIES)}")
    f = FAMILIES[family]
    # The folder's name carries a digest of the definition: a changed family is built anew, never read stale.
    digest = hashlib.sha256(repr((f.config_class, f.model_class, f.config, f.chat_template)).encode()).hexdigest()[:8]
    target = cache_dir() / "models" / f"tiny-{family}-s{seed}-{digest}"
    return materialize(target, _builder(FAMILIES[family], seed))


def _builder(family: Family, seed: int) -> Callable[[Path], str]:
    def build(out: Path) -> str:
        import torch
        import transformers

        from spanq_backend.serving.model_folders import load_smollm2_tokenizer, save_generation_config

        tokenizer = load_smollm2_tokenizer()
        if family.chat_template is not None:
            tokenizer.chat_template = family.chat_template
        shape: dict[str, Any] = {
            "vocab_size": len(tokenizer), "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 8192,
            "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
        if family.name == "gpt-oss":
            shape["intermediate_size"] = 256
        config = getattr(transformers, family.config_class)(**{**shape, **family.config})
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_class)(config).to(torch.float32)
        model.save_pretrained(out)
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(out)
        save_generation_config(out, tokenizer)
        return f"tiny {family.name}: random weights, torch.manual_seed({seed})"

    return build


_ARCHITECTURES: dict[str, Family] = {}
for _f in FAMILIES.values():
    _ARCHITECTURES.setdefault(_f.model_class, _f)  # the plain variant of a class (qwen3, not qwen3-yarn)


def family_of_config(config: dict[str, Any]) -> Family | None:
    """The family a model folder's config.json belongs to (by its architecture), or None."""
    for arch in config.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    return None


def _config_of(model_path: str | Path) -> dict[str, Any]:
    import json

    try:
        return json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def check_spans(model_path: str | Path) -> None:
    """Refuse spans on a model before vLLM starts: a family the table refuses (by name, with its reason), or a
    RoPE whose keys cannot move (`kv_layout.check_relocatable`). A family not in the table goes on to the
    start-up checks on the loaded model (its RoPE tables, its cache layout), which refuse what they cannot move."""
    from spanq_backend.kv.rerope import RelocationError
    from spanq_backend.vllm_integration.kv_layout import check_relocatable

    family = family_of_config(_config_of(model_path))
    if family is not None and family.spans.startswith("refused"):
        raise RelocationError(f"{Path(model_path).name} ({family.features}): spans {family.spans}")
    check_relocatable(model_path)


def family_line(model_path: str | Path) -> str:
    """What spanq says of a model as its engine starts: its family in the support table, or that the start-up
    checks on the loaded model decide."""
    family = family_of_config(_config_of(model_path))
    name = Path(model_path).name
    if family is None:
        return f"{name}: not a family spanq checks with a tiny model; the start-up checks on the loaded model decide"
    return f"{name}: {family.features}; spans {family.spans} (checked on tiny-{family.name})"


class UnsupportedModelError(ValueError):
    """A model folder vLLM cannot run (an architecture it does not know)."""


def check_loadable(model_path: str | Path) -> None:
    """Refuse, before any engine state is built, a model whose architecture vLLM does not run."""
    from vllm.model_executor.models import ModelRegistry

    config = _config_of(model_path)
    if not config:
        raise UnsupportedModelError(f"{Path(model_path).name}: config.json is missing or is not JSON")
    archs = list(config.get("architectures") or [])
    supported = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in supported for a in archs):
        raise UnsupportedModelError(
            f"{Path(model_path).name}: vLLM does not run the architecture {', '.join(archs)} (its config.json's "
            "`architectures`); spanq runs what vLLM runs"
        )
