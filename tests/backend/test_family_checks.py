"""The checks that decide, before and as an engine starts, whether spans are exact on a model: its config's
RoPE types and family (before vLLM starts), its KV cache groups and sliding windows (on the loaded runner)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from spanq_backend.kv.rerope import RelocationError
from spanq_backend.serving.families import FAMILIES, check_spans, family_line
from spanq_backend.vllm_integration.kv_layout import check_relocatable, has_sliding_window_layers
from spanq_backend.vllm_integration.worker import single_kv_cache_group, windows_cover_the_context


def folder(tmp_path: Path, **config) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "llama3", "factor": 8.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
    {"type": "linear", "factor": 2.0},
])
def test_relocatable_rope_types_pass(tmp_path, rope):
    check_relocatable(folder(tmp_path, rope_scaling=rope))


@pytest.mark.parametrize(("rope", "named"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "dynamic NTK"),
    ({"rope_type": "su"}, "switches frequencies"),
    ({"rope_type": "mrope", "mrope_section": [16, 24, 24]}, "multimodal"),
    ({"rope_type": "wavelet-9000"}, "which spanq does not know"),
])
def test_rope_types_that_cannot_move_are_refused_by_name(tmp_path, rope, named):
    with pytest.raises(RelocationError, match=named) as raised:
        check_relocatable(folder(tmp_path, rope_parameters=rope))
    assert repr(rope["rope_type"]) in str(raised.value)


def test_per_layer_type_rope_parameters_are_each_checked(tmp_path):
    """Gemma 3's config holds one RoPE per layer type: every one must move."""
    gemma3 = {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {"rope_type": "default"}}
    check_relocatable(folder(tmp_path, rope_parameters=gemma3))
    bad = {**gemma3, "full_attention": {"rope_type": "dynamic", "factor": 8.0}}
    with pytest.raises(RelocationError, match="dynamic"):
        check_relocatable(folder(tmp_path, rope_parameters=bad))


def test_a_missing_config_is_refused(tmp_path):
    with pytest.raises(RelocationError, match="cannot read"):
        check_relocatable(tmp_path)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.spans.startswith("refused")])
def test_a_family_the_table_refuses_is_refused_with_its_reason(tmp_path, name):
    family = FAMILIES[name]
    path = folder(tmp_path, architectures=[family.model_class])
    with pytest.raises(RelocationError) as raised:
        check_spans(path)
    assert family.spans in str(raised.value)
    assert "spans refused" in family_line(path)


def test_the_family_line_names_the_family_or_says_the_checks_decide(tmp_path):
    line = family_line(folder(tmp_path, architectures=["Qwen3ForCausalLM"]))
    assert "Qwen3: QK-norm before RoPE; spans exact (checked on tiny-qwen3)" in line
    assert "start-up checks on the loaded model decide" in family_line(folder(tmp_path, architectures=["XForCausalLM"]))


@pytest.mark.parametrize(("config", "sliding"), [
    ({"sliding_window": 4096}, True),
    ({"sliding_window": None}, False),
    ({"sliding_window": 4096, "use_sliding_window": False}, False),  # Qwen2's form
    ({"layer_types": ["sliding_attention", "full_attention"]}, True),
    ({}, False),
])
def test_sliding_window_layers_are_found_in_the_config(tmp_path, config, sliding):
    assert has_sliding_window_layers(folder(tmp_path, **config)) is sliding


def runner(groups=("FullAttentionSpec",), windows=(None,), max_model_len=2048):
    kinds = {name: type(name, (), {}) for name in groups}
    return SimpleNamespace(
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=kinds[g]()) for g in groups]),
        compilation_config=SimpleNamespace(
            static_forward_context={f"model.layers.{i}.self_attn.attn": SimpleNamespace(sliding_window=w)
                                    for i, w in enumerate(windows)}
        ),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )


def test_a_kv_cache_in_several_groups_is_refused():
    single_kv_cache_group(runner())
    with pytest.raises(RelocationError, match="split into 2 groups") as raised:
        single_kv_cache_group(runner(groups=("SlidingWindowSpec", "FullAttentionSpec")))
    assert "--disable-hybrid-kv-cache-manager" in str(raised.value)


def test_sliding_windows_must_cover_the_context():
    windows_cover_the_context(runner(windows=(None, 4096), max_model_len=4096))
    windows_cover_the_context(runner(windows=(None, None)))
    with pytest.raises(RelocationError, match="128-token window") as raised:
        windows_cover_the_context(runner(windows=(128, None, 4096), max_model_len=2048))
    assert "max_model_len <= 128" in str(raised.value)


@pytest.mark.vllm
def test_an_architecture_vllm_does_not_run_is_refused_before_any_engine_state(tmp_path):
    from spanq_backend.serving.engine import SpanEngine
    from spanq_backend.serving.families import UnsupportedModelError, check_loadable
    from spanq_integrations.query.errors import BackendError

    path = folder(tmp_path, architectures=["FrobnicatorForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="FrobnicatorForCausalLM"):
        check_loadable(path)
    check_loadable(folder(tmp_path, architectures=["Qwen3ForCausalLM"]))
    path = folder(tmp_path, architectures=["FrobnicatorForCausalLM"])
    with pytest.raises(BackendError, match="vLLM does not run the architecture FrobnicatorForCausalLM"):
        SpanEngine(model=str(path))
    # `spanq serve` admits a model through the same step (`serving.admission.admit`), in the same words.
    from spanq_backend.serving.server import parse_serve_args

    with pytest.raises(ValueError, match="vLLM does not run the architecture FrobnicatorForCausalLM"):
        parse_serve_args(["--model", str(path)])
