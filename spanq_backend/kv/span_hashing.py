"""Span-aware block hashing: a pure function of the tokens and the span table, chained like vLLM's.

- Context blocks before the first span chain from the start, exactly as stock vLLM hashes them.
- A span's first block chains on its anchor (the prefix's last block; nothing for a stand-alone span; the
  stock chain of explicit anchor tokens), not on the span before it, so the span hashes the same wherever it
  sits — and the same as in its prepare request `[anchor][span]`, whose stock hashes are identical.
- A context block after spans chains on a join of the last context hash and the ordered keys (last block
  hashes) of the spans in between: what follows a `plus` group depends on which spans, in which order.
Blocks past the prompt (generated tokens) continue the last chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spanq_backend.kv.span_table import SpanTable

__all__ = ["JOIN_TAG", "AnchorHash", "HashBlock", "anchor_chain", "span_block_hashes"]

# hash_block(parent_hash or None, block_token_ids, extra_keys or None) -> hash
HashBlock = Callable[[Any, Sequence[int], Any], Any]
# extra_keys(start_token, end_token) -> extra keys or None (LoRA name, cache salt, ...), as stock vLLM adds them
ExtraKeys = Callable[[int, int], Any]
# anchor_hash(explicit anchor tokens) -> the hash of their last block (`anchor_chain`), where a caller keeps them
AnchorHash = Callable[[tuple[int, ...]], Any]


def anchor_chain(anchor: Sequence[int], block_size: int, hash_block: HashBlock, extras: Callable[[int], Any]) -> Any:
    """The hash of explicit anchor tokens' last block, as stock vLLM hashes the first blocks of a span's prepare
    request `[anchor][span]` (`extras(start)`: the extra keys of the block that starts there)."""
    parent = None
    for k in range(0, len(anchor), block_size):
        parent = hash_block(parent, anchor[k : k + block_size], extras(k))
    return parent

JOIN_TAG = "spanq-join"


def span_block_hashes(
    token_ids: Sequence[int],
    table: SpanTable,
    hash_block: HashBlock,
    done: Sequence[Any] = (),
    extra_keys: ExtraKeys | None = None,
    anchor_hash: AnchorHash | None = None,
) -> list[Any]:
    """Hashes of the full blocks after the `done` ones (the request's hashes so far); `anchor_hash`: the hashes of
    explicit anchors where the caller keeps them (each worked out here otherwise, once a call)."""
    bs = table.block_size
    hashes = list(done)
    span_of_block: dict[int, int] = {}
    for i, (s, e) in enumerate(table.spans):
        for j in range(s // bs, e // bs):
            span_of_block[j] = i

    def extras(lo: int) -> Any:
        return extra_keys(lo, lo + bs) if extra_keys else None

    explicit: dict[tuple[int, ...], Any] = {}  # explicit anchor tokens -> the hash of their last block

    def span_parent(i: int) -> Any:
        anchor = table.anchor_of(i)
        if isinstance(anchor, int):
            return hashes[anchor // bs - 1] if anchor else None
        if anchor not in explicit:
            explicit[anchor] = (
                anchor_hash(anchor) if anchor_hash is not None else anchor_chain(anchor, bs, hash_block, extras)
            )
        return explicit[anchor]

    for j in range(len(hashes), len(token_ids) // bs):
        lo = j * bs
        block = token_ids[lo : lo + bs]
        i = span_of_block.get(j)
        if i is not None:
            start_block = table.spans[i][0] // bs
            parent = hashes[j - 1] if j > start_block else span_parent(i)
            # Extra keys as the span's prepare request `[anchor][span]` computes them.
            hashes.append(hash_block(parent, block, extras(lo - table.spans[i][0] + table.anchor_size(i))))
            continue
        if j == 0 or (j - 1) not in span_of_block:
            parent = hashes[j - 1] if j else None
        else:
            keys = []
            k = j - 1
            while k >= 0 and k in span_of_block:
                if k + 1 not in span_of_block or span_of_block[k + 1] != span_of_block[k]:
                    keys.append(hashes[k])  # the last block of a span is its key
                k -= 1
            keys.reverse()
            prev_context = hashes[k] if k >= 0 else None
            parent = hash_block(prev_context, (), (JOIN_TAG, *keys))
        hashes.append(hash_block(parent, block, extras(lo)))
    return hashes[len(done) :]
