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


# --------------------------------------------------------------------------------------------- every patch in PATCHES


def _vllm_assignments(source: str) -> list[str]:
    """Where a source assigns to an attribute of something it imported from vLLM (`entry.build_app = f`,
    `setattr(core, "x", f)`, function-local imports included): a patch made outside the registry."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm")
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(target, ast.Attribute) and isinstance(base, ast.Name) and base.id in names:
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_patches_vllm_outside_the_registry():
    """Every change to vLLM is a `Patch` in `PATCHES` (applied by `patching.Patch`): no module of the backend
    assigns to a vLLM attribute itself."""
    package = BACKEND.parent
    offenders = {
        str(path.relative_to(package)): found
        for path in sorted(package.rglob("*.py"))
        if path.name != "patching.py" and (found := _vllm_assignments(path.read_text()))
    }
    assert not offenders, f"patches outside PATCHES: {offenders}"


def test_the_check_above_finds_a_patch_made_in_place():
    """It can fail: the front end's route patch as it was written before it joined the registry is found."""
    before = '''
def query_route_mounted(router):
    from vllm.entrypoints.launchers.api_server import entry
    stock_build_app = entry.build_app
    entry.build_app = lambda *a: stock_build_app(*a)
    try:
        yield
    finally:
        entry.build_app = stock_build_app
'''
    assert len(_vllm_assignments(before)) == 2
    assert _vllm_assignments("from vllm.v1.engine import core\nsetattr(core, 'x', 1)\n")


def test_a_scoped_patch_holds_only_inside_and_is_not_applied_at_registration():
    from vllm.entrypoints.launchers.api_server import entry

    from spanq_backend.vllm_integration import PATCHES
    from spanq_backend.vllm_integration.frontend import MOUNT_QUERY_ROUTE, query_route_mounted

    assert {p.attr for p in PATCHES if p.process == "front end"} == {"cleanup_dist_env_and_memory", "build_app"}
    assert all(p.scoped for p in PATCHES if p.process == "front end")
    stock = entry.build_app
    assert not hasattr(stock, "__wrapped__"), "registration applied a scoped patch"
    with pytest.raises(RuntimeError, match="scoped patch"):
        MOUNT_QUERY_ROUTE.apply()
    with pytest.raises(KeyError), query_route_mounted(lambda: None):
        assert entry.build_app is not stock and entry.build_app.__wrapped__ is stock
        raise KeyError("left by an error")
    assert entry.build_app is stock
