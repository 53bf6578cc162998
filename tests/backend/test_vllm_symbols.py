"""spanq_backend.vllm_integration.symbols: the vLLM hooks the plugin relies on exist, and a change fails loudly."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from spanq_backend.vllm_integration import symbols as vllm_symbols
from spanq_backend.vllm_integration.symbols import (
    SYMBOLS,
    WRITTEN_FOR,
    VllmCompatibilityError,
    check_symbols,
    resolve,
)

pytestmark = [pytest.mark.vllm]

BACKEND = Path(vllm_symbols.__file__).parent


def test_check_symbols_passes_on_the_installed_vllm():
    import vllm

    assert vllm.__version__.startswith(WRITTEN_FOR.rsplit(".", 1)[0])
    check_symbols()


@pytest.mark.parametrize(
    "module, owner, attr",
    [
        ("vllm.v1.core.kv_cache_utils", None, "generate_block_hash_extra_keys"),
        ("vllm.v1.engine.core", None, "get_request_block_hasher"),
        ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "get_computed_blocks"),
        ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "execute_model"),
    ],
)
def test_a_vanished_symbol_is_named_with_the_versions(monkeypatch, module, owner, attr):
    import vllm

    target = importlib.import_module(module)
    if owner is None:
        monkeypatch.delattr(target, attr)
    else:
        # Remove it everywhere along the class's MRO: where vLLM defines it (CPUModelRunner inherits
        # execute_model) and where the registered plugin put its wrapper.
        for klass in getattr(target, owner).__mro__:
            if attr in vars(klass):
                monkeypatch.delattr(klass, attr)

    with pytest.raises(VllmCompatibilityError) as raised:
        check_symbols()

    message = str(raised.value)
    name = f"{module}.{owner}.{attr}" if owner else f"{module}.{attr}"
    assert name in message
    assert WRITTEN_FOR in message and vllm.__version__ in message


def test_a_changed_signature_is_named(monkeypatch):
    from vllm.v1.core import kv_cache_utils

    def hash_block_tokens(parent_block_hash, curr_block_token_ids, extra_keys=None, hash_function=None):
        raise AssertionError("never called")

    monkeypatch.setattr(kv_cache_utils, "hash_block_tokens", hash_block_tokens)
    with pytest.raises(VllmCompatibilityError) as raised:
        check_symbols()
    message = str(raised.value)
    assert "vllm.v1.core.kv_cache_utils.hash_block_tokens" in message
    assert "parent_block_hash" in message and "expected" in message


def test_every_problem_is_reported_at_once(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delattr(kv_cache_utils, "generate_block_hash_extra_keys")
    monkeypatch.delattr(cpu_attn, "_get_attn_isa")
    with pytest.raises(VllmCompatibilityError) as raised:
        check_symbols()
    assert "generate_block_hash_extra_keys" in str(raised.value) and "_get_attn_isa" in str(raised.value)


def test_resolve_follows_attribute_paths():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert (
        resolve("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks")
        is KVCacheManager.get_computed_blocks
    )
    with pytest.raises(AttributeError):
        resolve("vllm.v1.core.kv_cache_manager", "KVCacheManager.no_such_method")


# --------------------------------------------------------------------------------------------- the list is complete


def _vllm_uses(path: Path) -> set[tuple[str, str]]:
    """(module, attribute) pairs a source file takes from vLLM: `from m import x` and `alias.x` on module aliases."""
    tree = ast.parse(path.read_text())
    uses: set[tuple[str, str]] = set()
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(full)
                    aliases[a.asname or a.name] = full  # a module: its attributes are the uses
                except ImportError:
                    uses.add((node.module, a.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.add((aliases[node.value.id], node.attr))
    return uses


@pytest.mark.parametrize("source", sorted(p.name for p in BACKEND.glob("*.py")))
def test_every_vllm_symbol_the_plugin_touches_is_listed(source):
    listed = {(module, attr.split(".")[0]) for module, attr, _ in SYMBOLS}
    missing = sorted(_vllm_uses(BACKEND / source) - listed)
    assert not missing, f"{source} uses vLLM symbols that vllm_symbols.SYMBOLS does not list: {missing}"


def test_every_patch_is_a_listed_symbol():
    from spanq_backend.vllm_integration import PATCHES

    listed = {(module, attr) for module, attr, _ in SYMBOLS}
    for patch in PATCHES:
        if patch.wrap is not None:
            assert (patch.module, patch.attr) in listed, f"{patch.module}.{patch.attr} is patched but not listed"
        else:  # an added method: its class must be listed
            assert (patch.module, patch.attr.split(".")[0]) in listed, patch


def test_every_listed_symbol_says_what_spanq_relies_on():
    for module, attr, use in SYMBOLS:
        assert module.startswith("vllm") and attr and use.strip(), (module, attr)
