"""Every vLLM symbol the span plugin touches, in one place, with the vLLM version it was written against.

`check_symbols()` imports each one and raises `VllmCompatibilityError` naming the ones that moved or vanished;
a test runs it, so an upgrade of vLLM fails loudly instead of silently serving without spans.
"""

from __future__ import annotations

import importlib
import inspect

__all__ = ["SYMBOLS", "WRITTEN_FOR", "VllmCompatibilityError", "check_symbols", "resolve"]

WRITTEN_FOR = "0.32.0"

# (module, attribute path, what we rely on)
SYMBOLS: tuple[tuple[str, str, str], ...] = (
    ("vllm.v1.engine.core", "get_request_block_hasher", "imported by name; EngineCore.__init__ builds the hasher after plugins load"),
    ("vllm.v1.engine.core", "EngineCore._initialize_kv_caches", "EngineCore.__init__ calls it before it builds the hasher; spans are checked right after it"),
    ("vllm.v1.engine.core", "EngineCore.collective_rpc", "(method name) -> one answer per worker"),
    ("vllm.v1.engine.core", "EngineCore",
     "a utility call runs one of its methods by name between two steps (the plugin adds its pins': spanq_pin_blocks)"),
    ("vllm.v1.worker.worker_base", "WorkerBase", "every worker; gains the span-status method; model_runner"),
    ("vllm.v1.engine.llm_engine", "LLMEngine.collective_rpc", "the embedded engine asks its workers the same"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.collective_rpc", "spanq serve asks its workers the same"),
    ("vllm.v1.core.kv_cache_utils", "hash_block_tokens", "(hash_fn, parent_hash, token_ids, extra_keys) -> BlockHash"),
    ("vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys", "(request, start, end, mm_idx) -> (keys, mm_idx)"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks", "(request) -> (blocks, num_computed_tokens, boundary)"),
    ("vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager.get_num_blocks_to_allocate", "(request_id, num_tokens, ...) -> blocks needed; CIDRA adds its duplicates"),
    ("vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager.allocate_new_blocks", "(request_id, ...) -> new blocks; CIDRA duplicates hit blocks first"),
    ("vllm.v1.core.single_type_kv_cache_manager", "FullAttentionManager._apply_cow", "(request_id, block_idx, source, copy): vLLM's copy-on-write redirect"),
    ("vllm.v1.worker.gpu_model_runner", "copy_kv_cache_blocks_inplace", "module global the runner calls to copy blocks before the forward pass"),
    ("vllm.v1.request", "Request", "block_hashes (list, extended in place), sampling_params.extra_args, all_token_ids"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.execute_model", "(scheduler_output, intermediate_tensors) before the forward pass"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", "the hooked method; CPUModelRunner inherits it"),
    ("vllm.v1.kv_cache_layout", "KVCacheLayout", "the physical layouts of a cache; K stays at its logical place in each"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.do_kv_cache_update",
     "(layer, key, value, kv_cache, slot_mapping): the cache-write call of every backend; the GPU self-check's writer"),
    ("vllm.v1.core.sched.output", "NewRequestData", "req_id, block_ids, num_computed_tokens"),
    ("vllm.v1.core.sched.output", "CachedRequestData", "req_ids, resumed_req_ids, new_block_ids"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward",
     "(layer, query [tokens, heads, head], key, value, kv_cache, attn_metadata, output): the attention probe reads after it"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata",
     "query_start_loc, seq_lens, block_table: per request of the batch, in the runner's input_batch order"),
    ("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa", "(dtype, block_size, head_size) -> isa of the CPU KV layout"),
    ("vllm._custom_ops", "cpu_attn_reshape_and_cache", "writes K/V into the CPU cache; used to discover K's layout"),
    ("vllm.v1.engine.core", "cleanup_dist_env_and_memory", "module global EngineCore.shutdown calls; spared while other engines live"),
    ("vllm.v1.engine.llm_engine", "LLMEngine", "from_engine_args, add_request, step, abort_request"),
    ("vllm.v1.engine.core_client", "InprocClient", "engine_core: the in-process EngineCore (scheduler.kv_cache_manager)"),
    ("vllm.v1.core.block_pool", "BlockPool.touch", "(blocks): a reference more on each (a pin; evicted only when unreferenced)"),
    ("vllm.v1.core.block_pool", "BlockPool.free_blocks", "(blocks): a reference less on each (an unpin)"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.call_utility_async",
     "(method, *args): spanq serve calls the plugin's EngineCore methods (pins) between two steps"),
    ("vllm.v1.core.block_pool", "BlockPool.get_cached_block", "(block_hash, group_ids) -> blocks or None: SpanEngine's cache probe"),
    # spanq serve's prefix-cache mirror (cache_probe.KVEventsMirror): vLLM's KV events over ZMQ
    ("vllm.config.kv_events", "KVEventsConfig", "enable_kv_cache_events, publisher, endpoint, topic"),
    ("vllm.distributed.kv_events", "KVEventBatch", "msgpack payload of (topic, 8-byte sequence number, payload) messages"),
    ("vllm.distributed.kv_events", "BlockStored", "block_hashes (external form) of blocks now cached"),
    ("vllm.distributed.kv_events", "BlockRemoved", "block_hashes of blocks evicted"),
    ("vllm.distributed.kv_events", "AllBlocksCleared", "the whole prefix cache was reset"),
    ("vllm.utils.hashing", "get_hash_fn_by_name", "the engine's prefix_caching_hash_algo -> hash function"),
    ("vllm.v1.core.kv_cache_utils", "resolve_none_hash_seed", "(hash_fn) -> the seed of the engine core's NONE_HASH"),
    ("vllm.v1.core.kv_cache_utils", "BlockHash", "the bytes type of block hashes (the mirror's NONE_HASH)"),
    ("vllm.v1.core.kv_cache_utils", "maybe_convert_block_hash", "BlockHash -> the form KV events carry"),
    ("vllm.v1.core.kv_cache_utils", "_NON_CRYPTO_HASH_FUNCTIONS", "hash functions seeded at random per process"),
    ("vllm.engine.arg_utils", "EngineArgs", "model, dtype, block_size, enable_prefix_caching, max_model_len"),
    ("vllm.sampling_params", "SamplingParams", "extra_args carries the span table out of band"),
    ("vllm.sampling_params", "RequestOutputKind", "DELTA outputs for streaming"),
    ("vllm.inputs", "TokensPrompt", "prompts given as token ids"),
    # the span tier (tier.SpanTierConnector): vLLM's KV-connector interface, loaded by kv_connector_module_path
    ("vllm.config", "KVTransferConfig", "kv_connector, kv_connector_module_path, kv_role, kv_load_failure_policy, kv_connector_extra_config"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1",
     ("get_num_new_matched_tokens (async loads), update_state_after_alloc, build_connector_meta, start_load_kv, "
      "wait_for_save, get_transfer_results, bind_kv_cache_manager")),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorMetadata", "the per-step plan the worker gets"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole", "SCHEDULER / WORKER"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorTransferResults", "finished_recving, failed_recving"),
    ("vllm.platforms", "current_platform", "is_cpu(), device_type: the tier runs on the CPU backend only"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids", "(request_id) -> block ids per group: the blocks a prepare saves"),
    # spanq serve: vLLM's own OpenAI server with one more route
    ("vllm.entrypoints.launchers.api_server.entry", "build_app", "module global build_and_serve looks up; wrapped to add the route"),
    ("vllm.entrypoints.launchers.api_server.entry", "decorate_logs", "(name, skip_if_decorated) as run_server calls it"),
    ("vllm.entrypoints.launchers.api_server.entry", "setup_server", "(args, reuse_port) -> (address, socket)"),
    ("vllm.entrypoints.launchers.api_server.entry", "run_server_worker", "(address, sock, args, **uvicorn kwargs) runs the server"),
    ("vllm.entrypoints.launchers.cli_args", "make_arg_parser", "vllm serve's argument parser"),
    ("vllm.entrypoints.launchers.cli_args", "validate_parsed_serve_args", "vllm serve's argument checks"),
    ("vllm.entrypoints.serve.utils.api_utils", "with_cancellation", "aborts a route's work when the client leaves"),
    ("vllm.entrypoints.serve.utils.api_utils", "cli_env_setup", "environment set-up of vllm serve"),
    ("vllm.utils.argparse_utils", "FlexibleArgumentParser", "vllm's argparse"),
    ("vllm.exceptions", "VLLMClientError", "engine refusals of a request"),
    ("vllm.logger", "configure_logging_from_args", "logging as vllm serve does it"),
    ("vllm.v1.engine.async_llm", "AsyncLLM.generate", "the server's engine client: (prompt, params, request_id)"),
)

_SIGNATURES = {
    "get_computed_blocks": ["self", "request"],
    "get_num_blocks_to_allocate": ["self", "request_id", "num_tokens"],
    "allocate_new_blocks": ["self", "request_id", "num_tokens"],
    "_apply_cow": ["self", "request_id", "block_idx", "source_block", "cow_block"],
    "hash_block_tokens": ["hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys"],
    "get_cached_block": ["self", "block_hash", "kv_cache_group_ids"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "do_kv_cache_update": ["self", "layer", "key", "value", "kv_cache", "slot_mapping"],
}


class VllmCompatibilityError(RuntimeError):
    """The installed vLLM no longer has a hook the span plugin needs."""


def resolve(module: str, attr: str) -> object:
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_symbols() -> None:
    """Import every symbol and check the signatures we depend on; raise naming all that changed."""
    import vllm

    problems = []
    for module, attr, use in SYMBOLS:
        try:
            obj = resolve(module, attr)
        except (ImportError, AttributeError) as e:
            problems.append(f"{module}.{attr} ({use}): {e}")
            continue
        want = _SIGNATURES.get(attr.split(".")[-1])
        if want is not None:
            got = list(inspect.signature(obj).parameters)  # type: ignore[arg-type]
            if got[: len(want)] != want:
                problems.append(f"{module}.{attr}: parameters {got}, expected {want}")
    if problems:
        raise VllmCompatibilityError(
            f"spanq's vLLM plugin was written for vLLM {WRITTEN_FOR}; installed is {vllm.__version__}. "
            "Changed: " + "; ".join(problems)
        )
