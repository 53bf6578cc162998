"""Fixtures shared by the backend tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine(tiny_model):
    """A span-aware embedded engine on the tiny model, one per test module (a module's monkeypatches and cached
    spans stay with it)."""
    from spanq_backend.serving.engine import SpanEngine

    # Documents not cached are prepared alone first ("isolate") and no span block is recomputed in context
    # (`recompute=0`, not the default "first"): these modules check what reading prepared spans computes, against
    # the span reference; computing cold documents in context is `test_cold_spans.py`'s subject, recomputing
    # blocks `test_recompute.py`'s.
    eng = SpanEngine(model=str(tiny_model), block_size=32, max_model_len=2048, max_num_seqs=8, cold_spans="isolate",
                     recompute=0)
    yield eng
    eng.close()
