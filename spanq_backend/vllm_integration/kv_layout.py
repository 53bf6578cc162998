"""What the runner-side relocation needs to know about a loaded vLLM model: its RoPE and its K cache layout.

The CPU attention backend stores K in an instruction-set-specific layout (transposed on AVX2's "vec" path),
so the layout is discovered at start-up, not assumed: index-coded keys are written through vLLM's own
`cpu_attn_reshape_and_cache` into a scratch block, and read back to see where each (token, dim) landed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spanq_backend.kv.relocation import KLayout
from spanq_backend.kv.rerope import RelocationError, RopeSpec

__all__ = [
    "RELOCATABLE_ROPE_TYPES",
    "attention_layer_of",
    "backend_relocator",
    "backend_write_keys",
    "check_relocatable",
    "checked_relocator",
    "cpu_read_keys",
    "cpu_relocator",
    "cpu_write_keys",
    "discover_cpu_k_layout",
    "has_sliding_window_layers",
    "layer_names_of",
    "logical_read_keys",
    "read_keys",
    "rope_spec_of_model",
    "rope_spec_of_rotary",
    "rope_specs_of_layers",
    "self_check",
]


def _is_rotary(module: Any) -> bool:
    return hasattr(module, "rotary_dim") and (
        hasattr(module, "cos_sin_cache") or hasattr(module, "long_short_cos_sin_cache")
    )


def _rotary_table(rotary: Any) -> torch.Tensor:
    """The cos/sin table `rotary` reads keys' positions from, in fp32 (vLLM keeps it in the model's dtype)."""
    if hasattr(rotary, "long_short_cos_sin_cache"):
        # LongRoPE as vLLM runs it: one factor set for the whole engine, chosen by max_model_len against the
        # original context (short factors when it fits, long factors for every position otherwise).
        orig = int(rotary.original_max_position_embeddings)
        if getattr(rotary, "use_long_rope", False):
            return rotary._compute_cos_sin_cache(
                rotary.max_position_embeddings, rotary.long_factor, rotary.long_mscale
            ).float()
        return rotary._compute_cos_sin_cache(orig, rotary.short_factor, rotary.short_mscale).float()
    if hasattr(rotary, "_compute_cos_sin_cache"):
        try:
            return rotary._compute_cos_sin_cache().float()
        except TypeError:  # a variant whose table needs arguments: the buffer as the model holds it
            pass
    return rotary.cos_sin_cache.float()


def rope_spec_of_rotary(rotary: Any, what: str) -> RopeSpec:
    """One vLLM rotary embedding as a `RopeSpec`; refuses one whose keys cannot be moved exactly."""
    if getattr(rotary, "mrope_section", None):
        raise RelocationError(f"{what} uses multimodal RoPE; span relocation is not exact there")
    return RopeSpec.from_cos_sin_cache(
        _rotary_table(rotary),
        int(rotary.rotary_dim),
        int(rotary.head_size),
        bool(getattr(rotary, "is_neox_style", True)),  # LongRoPE's class is NeoX-only and says so by omission
        what=f"{type(rotary).__name__} of {what}",
    )


def _same_rotary(a: Any, b: Any) -> bool:
    if a is b:
        return True
    ta, tb = _rotary_table(a), _rotary_table(b)
    return (
        ta.shape == tb.shape and torch.equal(ta, tb) and a.rotary_dim == b.rotary_dim
        and getattr(a, "is_neox_style", True) == getattr(b, "is_neox_style", True) and a.head_size == b.head_size
    )


def rope_specs_of_layers(model: torch.nn.Module, layer_names: list[str]) -> list[RopeSpec]:
    """Each attention layer's RoPE (`layer_names`: vLLM's layer names, `model.layers.3.self_attn.attn`), for
    models with one rotary embedding and for models whose layers use several (Gemma 3's local and global bases).

    A layer's rotary embedding is the one inside the module that holds its attention (`...self_attn`). Refuses a
    model without a rotary embedding spanq recognizes, one whose rotary embeddings cannot move keys exactly, and
    one with several rotary embeddings where a layer's own cannot be told."""
    named = dict(model.named_modules())
    what = type(model).__name__
    rotaries = [m for m in named.values() if _is_rotary(m)]
    if not rotaries:
        raise RelocationError(
            f"{what} has no rotary position embedding that spanq recognizes; "
            "cached spans cannot be moved to new positions"
        )
    distinct: list[Any] = []
    for r in rotaries:
        if not any(_same_rotary(r, d) for d in distinct):
            distinct.append(r)
    specs = {id(r): rope_spec_of_rotary(r, what) for r in distinct}
    if len(distinct) == 1:
        return [specs[id(distinct[0])]] * len(layer_names)
    out = []
    for name in layer_names:
        holder = named.get(name.rsplit(".", 1)[0]) if "." in name else None
        own = [m for m in holder.modules() if _is_rotary(m)] if holder is not None else []
        if len(own) != 1:
            raise RelocationError(
                f"{what} uses {len(distinct)} different rotary embeddings and spanq cannot tell which one "
                f"attention layer {name!r} uses; cached spans cannot be moved to new positions"
            )
        out.append(next(specs[id(d)] for d in distinct if _same_rotary(own[0], d)))
    return out


def rope_spec_of_model(model: torch.nn.Module) -> RopeSpec:
    """The RoPE of a model whose layers all share one; refuses a model whose layers use several."""
    return rope_specs_of_layers(model, ["(any layer)"])[0]


def discover_cpu_k_layout(runner: Any, block_size: int, head_dim: int) -> KLayout:
    """Find where vLLM's CPU attention puts key (token, dim) inside a block, by writing coded keys."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = runner.kv_caches[0].dtype
    isa = _get_attn_isa(dtype, block_size, head_dim)
    n = block_size * head_dim
    # Offsets are written as base-16 digits, one pass per digit, so every code is exact even in bf16.
    offsets = torch.arange(n)
    found = torch.zeros(n, dtype=torch.long)
    digits = max(1, (n - 1).bit_length() + 3) // 4
    for k in range(digits):
        codes = ((offsets >> (4 * k)) & 15).to(torch.float32) + 1.0  # 1..16, never the zero of an empty slot
        scratch = torch.zeros(1, 1, 2 * block_size, head_dim, dtype=dtype)
        key_cache, value_cache = scratch.chunk(2, dim=2)
        keys = codes.view(block_size, 1, head_dim).to(dtype)
        ops.cpu_attn_reshape_and_cache(
            keys, torch.zeros_like(keys), key_cache, value_cache, torch.arange(block_size, dtype=torch.long), isa
        )
        got = scratch.view(-1)[:n].to(torch.float64).round().long() - 1  # digit k of the logical index there
        if int(got.min()) < 0 or int(got.max()) > 15:
            raise RelocationError(f"could not decode the CPU K cache layout for isa {isa!r}")
        found |= got << (4 * k)
    if sorted(found.tolist()) != list(range(n)):
        raise RelocationError(f"could not decode the CPU K cache layout for isa {isa!r}")
    index = torch.empty(n, dtype=torch.long)
    index[found] = torch.arange(n)  # logical (token, dim) -> physical offset
    return KLayout(block_size, head_dim, index.view(block_size, head_dim))


# RoPE variants whose cos/sin table (as vLLM builds it) is a rotation with position-independent frequencies,
# possibly times one constant factor: keys move exactly. LongRoPE is one of them as vLLM runs it (one factor set
# for the whole engine); dynamic NTK changes its frequencies with the sequence's length and is refused.
RELOCATABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "longrope"})
REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK scaling changes the rotary frequencies with the sequence's length",
    "su": "this early LongRoPE form switches frequencies with the sequence's length",
    "mrope": "multimodal RoPE rotates by several position ids per token",
}


def _model_config(model_path: str | Path) -> dict[str, Any]:
    import json

    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RelocationError(f"cannot read {path}: {e}") from e
    return cfg.get("text_config", cfg)


def _rope_parameter_sets(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The config's RoPE parameters: one set, or one per layer type (Gemma 3's `full_attention` and
    `sliding_attention`)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]


def has_sliding_window_layers(model_path: str | Path) -> bool:
    """Whether the model has sliding-window attention layers (vLLM then splits its KV cache into groups unless
    told not to, and spanq tells it not to: see `worker.single_kv_cache_group`)."""
    cfg = _model_config(model_path)
    if "sliding_attention" in (cfg.get("layer_types") or []):
        return True
    return cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True) is not False


def check_relocatable(model_path: str | Path) -> None:
    """Refuse, before vLLM starts, a model whose cached keys cannot be moved exactly to a new position.

    Reads the model folder's config.json: every RoPE type must be one of `RELOCATABLE_ROPE_TYPES`, with no
    multimodal sections. (The runner checks each loaded cos/sin table itself as well.)
    """
    cfg = _model_config(model_path)
    problems = []
    for rope in _rope_parameter_sets(cfg):
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type in REFUSED_ROPE_TYPES:
            problems.append(f"RoPE type {rope_type!r} ({REFUSED_ROPE_TYPES[rope_type]})")
        elif rope_type not in RELOCATABLE_ROPE_TYPES:
            problems.append(
                f"RoPE type {rope_type!r}, which spanq does not know (relocatable: "
                f"{', '.join(sorted(RELOCATABLE_ROPE_TYPES))})"
            )
        if rope.get("mrope_section") or rope.get("mrope_interleaved"):
            problems.append("multimodal RoPE sections")
    if cfg.get("position_embedding_type", "rope") not in ("rope", "rotary"):
        problems.append(f"position embedding {cfg['position_embedding_type']!r}")
    if problems:
        raise RelocationError(
            f"{Path(model_path).name}: cached spans cannot be moved exactly with "
            + " and ".join(dict.fromkeys(problems)) + "; use it without spans (a stock engine) instead"
        )


def cpu_write_keys(kv_cache: torch.Tensor, keys: torch.Tensor, block_id: int) -> None:
    """Write `keys` (`[block_size, kv_heads, head_dim]`) into block `block_id` of one layer's CPU_ATTN cache
    (`[num_blocks, kv_heads, block_size, 2 * head_dim]`) the way vLLM's CPU attention writes them: through
    `cpu_attn_reshape_and_cache`, with the same view of the cache (values are written as zeros)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, heads, block_size, _ = kv_cache.shape
    head_dim = keys.shape[-1]
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.arange(block_id * block_size, (block_id + 1) * block_size, dtype=torch.long)
    keys = keys.to(kv_cache.dtype).contiguous()
    isa = _get_attn_isa(kv_cache.dtype, block_size, head_dim)
    ops.cpu_attn_reshape_and_cache(keys, torch.zeros_like(keys), key_cache, value_cache, slots, isa)


def read_keys(kv_cache: torch.Tensor, layout: KLayout, block_id: int) -> torch.Tensor:
    """Block `block_id`'s keys as `[block_size, kv_heads, head_dim]`, read through `layout` (what the relocator
    believes about where each key lives)."""
    num_blocks, heads = kv_cache.shape[0], kv_cache.shape[1]
    bs, hd = layout.block_size, layout.head_dim
    region = kv_cache.view(num_blocks, heads, 2 * bs * hd)[block_id, :, : bs * hd]  # [heads, bs * hd]
    return region[:, layout.flat_index.reshape(-1)].view(heads, bs, hd).transpose(0, 1)


SELF_CHECK_DELTA = 37  # positions the self-check moves its keys by (any delta the rotary table covers)

WriteKeys = Callable[[torch.Tensor, torch.Tensor, int], None]  # (layer's cache, keys [bs, heads, hd], block)
ReadKeys = Callable[[torch.Tensor, int], torch.Tensor]  # (layer's cache, block) -> keys [bs, heads, hd]


def cpu_read_keys(layout: KLayout) -> ReadKeys:
    """A reader through the CPU K layout `layout`."""
    return lambda kv, block: read_keys(kv, layout, block)


def logical_read_keys(head_dim: int) -> ReadKeys:
    """A reader of K at its logical place (`[blocks, heads, block_size, 2 * head_dim]`, K first)."""
    return lambda kv, block: kv[block, :, :, :head_dim].transpose(0, 1)


def backend_write_keys(layer: Any) -> WriteKeys:
    """A writer through the attention backend's own cache-write op: `layer.impl.do_kv_cache_update`, the call
    every vLLM 0.32 attention backend makes to store a step's keys and values (values are written as zeros)."""

    def write(kv: torch.Tensor, keys: torch.Tensor, block: int) -> None:
        bs = kv.shape[2]
        slots = torch.arange(block * bs, (block + 1) * bs, dtype=torch.long, device=kv.device)
        k = keys.to(device=kv.device, dtype=kv.dtype).contiguous()
        layer.impl.do_kv_cache_update(layer, k, torch.zeros_like(k), kv, slots)

    return write


def layer_names_of(runner: Any, kv_caches: list[torch.Tensor]) -> list[str]:
    """The name of the attention layer owning each cache (`""` where none is found). Refuses a cache listed
    twice: it would be moved twice."""
    if len({kv.data_ptr() for kv in kv_caches}) != len(kv_caches):
        raise RelocationError("the model runner lists one KV cache tensor for several layers; it would be moved twice")
    owner: dict[int, str] = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        caches = getattr(layer, "kv_cache", None)
        for c in [caches] if isinstance(caches, torch.Tensor) else caches or []:
            if isinstance(c, torch.Tensor):
                owner.setdefault(c.data_ptr(), getattr(layer, "layer_name", name))
    return [owner.get(kv.data_ptr(), "") for kv in kv_caches]


def attention_layer_of(runner: Any, kv_cache: torch.Tensor) -> Any:
    """The attention layer (with its backend `impl`) that owns `kv_cache`, from the runner's forward context."""
    context = runner.compilation_config.static_forward_context
    layers = [m for m in context.values() if hasattr(getattr(m, "impl", None), "do_kv_cache_update")]
    for layer in layers:
        caches = getattr(layer, "kv_cache", None) or []
        if any(isinstance(c, torch.Tensor) and c.data_ptr() == kv_cache.data_ptr() for c in caches):
            return layer
    if not layers:
        raise RelocationError("the model runner has no attention layer with a cache-write op spanq knows")
    return layers[0]


def self_check(
    kv_caches: list[torch.Tensor],
    spec: RopeSpec,
    *,
    write_keys: WriteKeys,
    read_keys: ReadKeys,
    make_relocator: Callable[[list[torch.Tensor]], Any],
    block_size: int,
) -> None:
    """The start-up check on the real cache, on every layer it guards: known keys are written into two blocks of
    each layer's cache through the attention backend's own op (`write_keys`), read back where the relocator
    believes keys live (`read_keys`), moved by the relocator the engine will use (`make_relocator`, over all the
    layers at once, as a step moves them) — one block forward and one back (`SELF_CHECK_DELTA`) — read back
    again and compared with the reference rotation (`rerope_`). The blocks are restored afterwards. Raises
    `RelocationError` saying what did not match, and on which layer; then the engine must not honour spans."""
    from spanq_backend.kv.relocation import Move
    from spanq_backend.kv.rerope import rerope_

    if not kv_caches or kv_caches[0].shape[0] < 2:
        raise RelocationError("start-up self-check: the KV cache has fewer than two blocks to check on")
    last = kv_caches[0].shape[0] - 1  # the last blocks: free at start-up, restored below either way
    moves = [Move(last, SELF_CHECK_DELTA), Move(last - 1, -SELF_CHECK_DELTA)]
    gen = torch.Generator().manual_seed(0)
    saved = [kv[last - 1 :].clone() for kv in kv_caches]
    try:
        written = []
        for layer, kv in enumerate(kv_caches):
            keys_of = {}
            for move in moves:
                keys = torch.randn(block_size, kv.shape[1], spec.head_dim, generator=gen).to(kv.dtype).to(kv.device)
                write_keys(kv, keys, move.block_id)
                if not torch.equal(read_keys(kv, move.block_id), keys):
                    raise RelocationError(
                        f"start-up self-check: the keys the attention backend wrote are not where the K layout "
                        f"says (layer {layer})"
                    )
                keys_of[move.block_id] = keys
            written.append(keys_of)
        make_relocator(kv_caches).apply(moves)
        tol = 1e-4 if kv_caches[0].dtype == torch.float32 else 2e-2
        for layer, (kv, keys_of) in enumerate(zip(kv_caches, written)):
            for move in moves:
                keys = keys_of[move.block_id]
                got = read_keys(kv, move.block_id).to(torch.float32)
                want = rerope_(keys.to(torch.float32).transpose(0, 1).clone(), move.delta, spec).transpose(0, 1)
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
                if not err <= tol:
                    raise RelocationError(
                        f"start-up self-check: keys moved by {move.delta:+d} positions on the real cache differ from "
                        f"the reference rotation on layer {layer} (relative error {err:.2e}, tolerance {tol:.0e})"
                    )
    finally:
        for kv, blocks in zip(kv_caches, saved):
            kv[last - 1 :].copy_(blocks)


def checked_relocator(runner: Any, kv_caches: list[torch.Tensor], spec: RopeSpec, block_size: int) -> Any:
    """The relocator for this runner's caches, after the start-up self-check passed on them (raises
    `RelocationError` otherwise): `cpu_relocator` for vLLM's CPU attention, `backend_relocator` elsewhere."""
    if kv_caches[0].device.type == "cpu":
        return cpu_relocator(runner, kv_caches, spec, block_size)
    return backend_relocator(runner, kv_caches, spec, block_size)


def cpu_relocator(runner: Any, kv_caches: list[torch.Tensor], spec: RopeSpec, block_size: int) -> Any:
    """vLLM's CPU attention keeps K in an instruction-set-specific order inside each block: found by writing coded
    keys through its op, moved by spanq's compiled CPU op (or torch)."""
    from spanq_backend.kv.relocation import KVRelocator

    layout = discover_cpu_k_layout(runner, block_size, spec.head_dim)
    self_check(
        kv_caches, spec, write_keys=cpu_write_keys, read_keys=cpu_read_keys(layout),
        make_relocator=lambda caches: KVRelocator(caches, layout, spec), block_size=block_size,
    )
    return KVRelocator(kv_caches, layout, spec)


def backend_relocator(runner: Any, kv_caches: list[torch.Tensor], spec: RopeSpec, block_size: int) -> Any:
    """The GPU backends store K at its logical place in any KVCacheLayout; the self-check confirms that through
    the backend's own cache-write op (`do_kv_cache_update` of the layer owning the first cache) before the strided
    relocator (Triton on CUDA) is trusted."""
    from spanq_backend.kv.strided import StridedKVRelocator

    def write_keys(kv: torch.Tensor, keys: torch.Tensor, block: int) -> None:  # through each layer's own op
        backend_write_keys(attention_layer_of(runner, kv))(kv, keys, block)

    self_check(
        kv_caches, spec, write_keys=write_keys, read_keys=logical_read_keys(spec.head_dim),
        make_relocator=lambda caches: StridedKVRelocator(caches, spec), block_size=block_size,
    )
    return StridedKVRelocator(kv_caches, spec)
