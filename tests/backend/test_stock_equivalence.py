"""Invariant 7 end to end: a request without a span table is served exactly as vLLM serves it with the plugin off.

The stock side runs in a process of its own with `SPANQ_DISABLE_PLUGIN=1` (no hook of spanq's is installed
there); the span side is the shared plugin-on engine of the test session. Both run the same prompts (some
sharing prefixes, so the prefix cache is hit) greedily, with log-probabilities, one after another.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.backend.logprobs import greedy_runs
from tests.servers import Ahead, AheadOnce

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STOCK_RUN = r"""
import json, sys
from spanq_backend import vllm_integration
from spanq_backend.serving.engine import SpanEngine
from tests.backend.logprobs import greedy_runs

engine = SpanEngine(model=sys.argv[1], spans=False, max_model_len=2048, max_num_seqs=8)
assert not vllm_integration._registered, "the plugin loaded although SPANQ_DISABLE_PLUGIN=1"
prompts = [engine.tokenizer.encode(t) for t in json.loads(sys.argv[2])]
print("RESULT " + json.dumps({"prompts": prompts, "runs": greedy_runs(engine, prompts)}))
engine.close()
"""

BASE = "You are a careful assistant. " * 12
TEXTS = [BASE + "Name three colours.", BASE + "Name three rivers.", "Count to five.", BASE + "Name three colours."]


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


def _start_stock_run() -> Ahead:
    from spanq_backend.serving.models import tiny_model_path

    env = {**os.environ, "SPANQ_DISABLE_PLUGIN": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-c", STOCK_RUN, str(tiny_model_path()), json.dumps(TEXTS)]
    # in the repository: `tests.backend.logprobs` is importable there
    return Ahead(command, env=env, cwd=Path(__file__).resolve().parents[2])


# Started once the session's tests are collected (tests/conftest.py): the stock process's ~25 s (an import of vLLM,
# an engine start, four short prompts) overlap the tests before this module's.
RUN = AheadOnce("stock", _start_stock_run)
start_ahead, stop_ahead = RUN.start_ahead, RUN.stop_ahead


@pytest.fixture(scope="module")
def stock(tiny_backend) -> list[dict]:
    done = RUN.result()
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(line.removeprefix("RESULT "))
    assert results["prompts"] == _prompts(tiny_backend.engine.tokenizer), "both sides run the same tokens"
    runs = results["runs"]
    assert runs[-1]["cached"] > 0, "the stock run hit its prefix cache (the repeated prompt)"
    return runs


def same(stock: list[dict], ours: list[dict]) -> bool:
    """Every prompt's tokens equal and each token's log-prob within 1e-5; a missing prompt or token differs."""
    return len(stock) == len(ours) and all(
        s["tokens"] == p["tokens"]
        and len(s["logprobs"]) == len(p["logprobs"])
        and max(abs(a - b) for a, b in zip(s["logprobs"], p["logprobs"], strict=True)) < 1e-5
        for s, p in zip(stock, ours, strict=True)
    )


def test_requests_without_spans_equal_vllm_with_the_plugin_off(tiny_backend, stock):
    engine = tiny_backend.engine
    assert same(stock, greedy_runs(engine, _prompts(engine.tokenizer)))


def test_a_plugin_that_moved_stock_keys_would_be_caught(tiny_backend, stock, monkeypatch):
    """The check can fail: a runner that rotates the cached blocks of stock requests differs from stock."""
    from spanq_backend.kv.relocation import BlockPositionTracker, Move

    stock_new_request = BlockPositionTracker.new_request

    def new_request(self, req_id, block_ids, num_computed_tokens):
        moves = stock_new_request(self, req_id, block_ids, num_computed_tokens)
        hits = list(block_ids)[: num_computed_tokens // self.block_size]
        return moves + [Move(b, 7) for b in hits]

    monkeypatch.setattr(BlockPositionTracker, "new_request", new_request)
    engine = tiny_backend.engine
    ours = greedy_runs(engine, _prompts(engine.tokenizer))  # cached by the test above: every one hits
    assert not same(stock, ours), "stock keys rotated by 7 positions went unnoticed"


def test_a_result_missing_a_prompt_or_a_token_is_not_the_same(stock):
    """The comparison can fail on length: a run that lost its last prompt, or stopped a token early, differs."""
    assert same(stock, [dict(r) for r in stock])
    assert not same(stock, stock[:-1]), "a missing prompt went unnoticed"
    short = [dict(r) for r in stock]
    short[0] = {**short[0], "tokens": short[0]["tokens"][:-1], "logprobs": short[0]["logprobs"][:-1]}
    assert not same(stock, short), "a result one token short went unnoticed"
