"""`cache_probe.KVEventsMirror`: the prefix cache of an engine core in another process, followed through vLLM's
KV events. Messages are vLLM's own event types, encoded as vLLM's publisher encodes them and sent over a real
ZMQ socket in the publisher's wire format (topic, sequence number, payload); `spanq serve` is tested end to end
in test_server.py."""

from __future__ import annotations

import time
import uuid

import pytest

pytestmark = [pytest.mark.vllm]

BS = 4


@pytest.fixture
def wire(tmp_path):
    import msgspec
    import zmq
    from vllm.utils.hashing import get_hash_fn_by_name

    from spanq_backend.vllm_integration.cache_probe import KVEventsMirror

    endpoint = f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:8]}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    mirror = KVEventsMirror(endpoint, "kv", get_hash_fn_by_name("sha256"), BS)
    encoder = msgspec.msgpack.Encoder()
    state = {"seq": 0}

    def publish(events, seq):
        from vllm.distributed.kv_events import KVEventBatch

        payload = encoder.encode(KVEventBatch(ts=time.time(), events=list(events)))
        pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    def wait_applied(count, timeout=10.0):
        deadline = time.time() + timeout
        while mirror.events < count:
            assert time.time() < deadline, "the mirror never received the batch"
            time.sleep(0.005)

    # A SUB socket joins late: empty batches until one arrives (each with the next number, as vLLM's are).
    deadline = time.time() + 10
    while mirror.events == 0:
        assert time.time() < deadline, "the mirror never subscribed"
        state["seq"] += 1
        publish([], state["seq"])
        time.sleep(0.02)

    def send(*events, seq=None):
        state["seq"] = state["seq"] + 1 if seq is None else seq
        applied = mirror.events
        publish(events, state["seq"])
        wait_applied(applied + 1)

    yield mirror, send
    mirror.close()
    pub.close(linger=0)


def stored(mirror, tokens):
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from spanq_backend.vllm_integration.cache_probe import block_hash_chain

    hashes = [maybe_convert_block_hash(h) for h in block_hash_chain(mirror.hash_fn, tokens, BS, mirror.root)]
    event = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BS, lora_id=None,
                        medium="GPU", lora_name=None)
    return event, hashes


def test_stored_blocks_are_cached_and_removed_ones_are_not(wire):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    mirror, send = wire
    prompt = list(range(100, 112))  # three blocks
    event, hashes = stored(mirror, prompt)
    assert not mirror.cached(prompt)
    send(event)
    assert mirror.cached(prompt)
    assert mirror.cached(prompt[:8]), "a prefix of whole cached blocks"
    assert not mirror.cached(prompt[:10]), "a partial block is never cached"
    assert not mirror.cached(list(range(200, 212)))
    send(BlockRemoved(block_hashes=[hashes[2]], medium="GPU"))
    assert not mirror.cached(prompt) and mirror.cached(prompt[:8])
    send(AllBlocksCleared())
    assert not mirror.cached(prompt[:4])


def test_a_gap_in_the_event_numbers_forgets_everything(wire):
    mirror, send = wire
    first, _ = stored(mirror, list(range(10, 18)))
    second, _ = stored(mirror, list(range(30, 38)))
    send(first)
    assert mirror.cached(list(range(10, 18)))
    send(second, seq=mirror.last_seq + 5)  # events were lost: a removal may be among them
    assert mirror.resets == 1
    assert not mirror.cached(list(range(10, 18)))
    assert mirror.cached(list(range(30, 38))), "what arrives after the gap is applied"


def chains_agree(chain) -> bool:
    """Whether `chain` (a memoizing `block_hash_chain`) gives vLLM's hashes: for prompts that share their second
    block after different first blocks, and for the same prompt again (read from the memo)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    def reference(tokens):
        parent, out = b"root", []
        for start in range(0, len(tokens), BS):
            parent = hash_block_tokens(sha256, parent, tokens[start : start + BS], None)
            out.append(parent)
        return out

    memo: dict = {}
    prompts = [[1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 9, 9, 9, 9], [1, 2, 3, 4, 9, 9, 9, 9]]
    return all(list(chain(sha256, p, BS, b"root", memo)) == reference(p) for p in prompts)


def test_remembered_block_hashes_are_vllms_hashes():
    """The probes remember block hashes by (parent, block): a memo keyed on the block alone would give the second
    prompt's second block the first prompt's hash (its parent differs), and it fails this check."""
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    from spanq_backend.vllm_integration.cache_probe import block_hash_chain

    assert chains_agree(block_hash_chain)

    def keyed_on_the_block_alone(hash_fn, tokens, block_size, root, memo):
        parent = root
        for start in range(0, len(tokens), block_size):
            block = tuple(tokens[start : start + block_size])
            if block not in memo:
                memo[block] = hash_block_tokens(hash_fn, parent, block, None)
            parent = memo[block]
            yield parent

    assert not chains_agree(keyed_on_the_block_alone)
