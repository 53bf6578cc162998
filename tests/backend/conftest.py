"""Fixtures shared by the backend tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shared_engine(tiny_model):
    """The span-aware embedded engine on the tiny model that the backend test modules share (one start, ~4 s,
    instead of one per module); each module gets it through `engine`, its cache emptied first."""
    from spanq_backend.serving.engine import SpanEngine

    # Documents not cached are prepared alone first ("isolate") and no span block is recomputed in context
    # (`recompute=0`, not the default "first+question"): these modules check what reading prepared spans computes, against
    # the span reference; computing cold documents in context is `test_cold_spans.py`'s subject, recomputing
    # blocks `test_recompute.py`'s.
    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8, cold_spans="isolate",
                     recompute=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def engine(shared_engine):
    """The shared engine, as a module finds it: nothing cached (no span or prefix another module left), so what a
    module's first call prepares and reads from the cache is its own doing. (A module's monkeypatches are undone
    after each test by pytest's `monkeypatch`.)"""
    assert shared_engine.reset_prefix_cache(), "the shared engine was still running requests between modules"
    return shared_engine
