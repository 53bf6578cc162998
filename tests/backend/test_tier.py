"""The span tier: span KV that outlives the engine (spanq_backend/vllm_integration/tier.py, `spanq prepare`).

The engine tests run in a process of their own (`tier_run.py`: an engine with a tier must be the only vLLM
engine of its process): a corpus compiled by `spanq prepare`'s entry point, then engines started one after
another on the tier, each a restart that finds only the folder. What they answer is checked here against the
independent HF reference of span attention, and the two broken tiers in that run (keys loaded without telling
where they sit; a flipped byte read without its checksum) must answer wrong.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks.hf_span import span_reference_logprobs
from spanq_backend.kv.span_table import SpanTable
from spanq_backend.serving.prepare import read_corpus
from spanq_backend.vllm_integration import tier
from spanq_backend.vllm_integration.frontend import InProcessEngines
from tests.servers import Ahead, AheadOnce

ROOT = Path(__file__).resolve().parents[2]
TOL = 2e-4
DOCS = [
    f"Document {c}. " + " ".join(f"The {w} of {c} is {i}." for i, w in enumerate(["key", "door", "lamp", "road", "tree", "bell", "cup"] * 3))
    for c in "ABCD"
]


def _start_run() -> Ahead:
    """Write the corpus and start the tier run (`tier_run.py`, in a process of its own) in the background."""
    folder = Path(tempfile.mkdtemp(prefix="spanq-tests-tier-"))
    corpus = folder / "corpus.jsonl"
    lines = [json.dumps({"text": DOCS[0]}), json.dumps({"page_content": DOCS[1]}), "{not json", json.dumps(DOCS[2]),
             json.dumps({"title": "no text"}), json.dumps({"content": DOCS[3]}), json.dumps("word " * 5000)]
    corpus.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "tests.backend.tier_run", str(corpus), str(folder / "tier")]
    return Ahead(command, env=env, cwd=ROOT, owns=[folder])


# Started once the session's tests are collected (tests/conftest.py), when one that reads the run is among them:
# its ~65 s (an import of vLLM and ten engine starts, little compute) overlap the tests before it.
RUN = AheadOnce("run", _start_run)
start_ahead, stop_ahead = RUN.start_ahead, RUN.stop_ahead


@pytest.fixture(scope="module")
def run():
    done = RUN.result()
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr, RUN.running.owns[0]


def reference(hf_model, out, spans: int | None = None):
    """Span attention over the run's prompt; `spans`: only the first so many read as spans, the rest of the prompt
    (the other spans' tokens included) read in context."""
    n = len(out["spans"]) if spans is None else spans
    anchors = [a if isinstance(a, int) else tuple(a) for a in out["anchors"]][:n] if out["anchors"] else None
    table = SpanTable(block_size=32, spans=tuple(tuple(s) for s in out["spans"][:n]),
                      anchors=tuple(anchors) if anchors is not None else None)
    return span_reference_logprobs(hf_model, out["token_ids"], table, out["tokens"]).double()


def max_diff(hf_model, out, spans: int | None = None) -> float:
    got = torch.tensor(out["logprobs"], dtype=torch.float64)
    diff = (got - reference(hf_model, out, spans)).abs()
    return float("inf") if torch.isnan(diff).any() else float(diff.max())


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_spanq_prepare_compiles_a_corpus_names_bad_lines_and_skips_what_the_tier_holds(run):
    result, stderr, _ = run
    first, again = result["prepare"], result["prepare_again"]
    assert result["prepare_exit"] == 1, "lines that are not documents make the exit status 1"
    assert "corpus.jsonl:3: not JSON" in stderr and "corpus.jsonl:5: not a document" in stderr
    # named by its line (7), not by its rank among the documents read (5, once two lines were skipped)
    assert "corpus.jsonl:7: too long for the model's context window" in stderr, "named, and the rest compiled"
    assert first["documents"] == 5 and first["too_long"] == 1
    assert first["spans"] == 4 and first["prepared"] == 4 and first["held"] == 0
    assert first["blocks_written"] > 4 and first["bytes_written"] > 0 and first["blocks_evicted"] == 0
    assert again["prepared"] == 0 and again["held"] == 4 and again["blocks_written"] == 0
    assert result["prepare_files"]["pin"] == result["prepare_files"]["kv"] > 4, "--pin pins every block it writes"
    assert result["prepare_again_files"] == result["prepare_files"], "and every block of the corpus it finds held"


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_a_restarted_engine_loads_every_span_from_the_tier_and_answers_span_attention_exactly(run, hf_model):
    out = run[0]["restart"]
    assert out["prepared"] == 0, "every span was in the tier: none computed"
    assert out["tier"]["loads"] >= 4 and out["tier"]["failed_loads"] == 0
    assert max_diff(hf_model, out) < TOL
    # what /metrics shows of it (spanq_tier_*)
    assert out["metrics"]["tier_loaded_blocks"] == out["tier"]["loaded_blocks"] > 0
    assert out["metrics"]["tier_blocks"] == out["tier"]["blocks"] and out["metrics"]["tier_failed_loads"] == 0


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_a_span_query_loads_its_spans_from_the_tier_itself_and_moves_them_exactly(run, hf_model):
    """No prepare round: the query's own request loads its spans after the prefix, stored at their prepare
    positions, and they are moved to where the query reads them."""
    out = run[0]["direct"]
    assert out["prepared"] == 0 and out["tier"]["loads"] >= 1 and out["tier"]["failed_loads"] == 0
    assert max_diff(hf_model, out) < TOL
    # `generate` in another order: the spans the engine does not hold whole (their anchors were never loaded by the
    # request above) are loaded by its own request too, none prepared
    assert out["generate"] == {"mode": "tier", "prepared_spans": 0}
    # a call that recomputes blocks has its spans loaded by prepares first (its recompute runs read them cached)
    assert out["recompute"]["mode"] == "isolate" and out["recompute"]["prepared_spans"] == 0
    assert out["recompute"]["recomputed_tokens"] > 0


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_a_query_that_recomputes_blocks_reads_its_spans_from_memory_when_its_prefix_is_only_in_the_tier(run):
    """A restarted engine's own spans are in its memory; the query's prefix is in the tier (earlier engines saved
    it), not in its cache. Loaded in the answer's step, the prefix came a step late for the recompute runs, whose
    lookups then stopped at the first block recomputed beside them and computed everything after it in context:
    on SmolLM2 at 8 x 512 a warm query took 24 s instead of 0.6 (`spanq bench tier`). Loaded first, the answer
    reads every span block but the recomputed ones from the cache."""
    out = run[0]["recompute_after_restart"]
    assert out["prefix_in_tier"] and not out["prefix_cached"], "the situation the test is about"
    assert out["mode"] == "warm" and out["recomputed_tokens"] > 0
    assert out["cached_tokens"] >= 0.6 * out["prompt_tokens"], out


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_prepares_that_share_an_anchor_held_by_the_tier_load_it_once(run):
    """A compile's prepares go to the engine together, each `[anchor][document]`, the anchor in the tier. vLLM
    caches a loaded block only once its load is done, so each prepare used to load the anchor into blocks of its
    own: four copies of it in the KV cache, four times the reads (on a small cache, evictions). The first loads
    it; the others wait a step and read its copy."""
    out, broken = run[0]["recompute_after_restart"]["compile"], run[0]["loads_twice"]["compile"]
    assert out["prepares"] == 4 and out["shared_blocks"] >= 2
    assert out["shared_in_tier"] == out["shared_blocks"], "the situation the test is about: the anchor is in the tier"
    assert out["loaded_blocks"] == out["shared_blocks"], out
    # the check can fail: the connector that lets every prepare load it (the behaviour before) loads it four times
    assert broken["shared_in_tier"] == broken["shared_blocks"] == out["shared_blocks"]
    assert broken["loaded_blocks"] == broken["prepares"] * broken["shared_blocks"], broken
    assert run[0]["loads_twice"]["mode"] == "warm", "and answers all the same"


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_keys_loaded_without_their_position_would_answer_wrong(run, hf_model):
    """The check above can fail: a tier that fills blocks and does not tell spanq where their keys sit (into
    blocks that held keys at other positions) moves them by the wrong distance."""
    out = run[0]["stale"]
    assert out["prepared"] == 0 and out["tier"]["loads"] >= 4
    assert max_diff(hf_model, out) > 10 * TOL


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_a_corrupt_block_is_refused_and_its_span_computed_and_unchecked_it_answers_wrong(run, hf_model):
    result = run[0]
    out = result["corrupt"]
    assert out["tier"]["failed_loads"] == 1
    assert out["prepared"] == 1, "the span with the corrupt block was computed"
    assert max_diff(hf_model, out) < TOL
    assert Path(result["flipped"]).with_suffix(".bad").exists(), "moved aside, never read again"
    assert max_diff(hf_model, result["unchecked"]) > 10 * TOL, "read without its checksum, the flip reaches the answer"


@pytest.mark.vllm
@pytest.mark.slow  # `run`: one process, ten engine starts (~65 s): in make test, not make test-fast
def test_a_query_that_loads_a_corrupt_block_computes_it_in_context_and_never_caches_that_as_the_span(run, hf_model):
    """The query's own request loads its spans (no prepare round) and is refused the first block of its second
    span: vLLM starts the request over, the tier's lookup stops before the refused block, and that block and all
    that follows are computed in context — the first span read as a span, the rest as full attention, exactly.
    Nothing computed in context is kept under a span's key (the engine's cache holds none of the later spans'
    blocks after it; an engine that kept them there, `unkeyed`, fails that), and the same query asked again, its
    spans prepared, computes the refused span alone (the tier no longer holds it) and answers span attention
    exactly."""
    result = run[0]
    out = result["corrupt_direct"]
    assert result["flipped"] == out["span_blocks"][1][0], "the flipped file is the second span's first block"
    assert out["prepared"] == 0 and out["tier"]["failed_loads"] == 1
    assert max_diff(hf_model, out, spans=1) < TOL
    cached = out["span_blocks_cached"]
    assert all(cached[0]) and not any(any(c) for c in cached[1:]), "what was computed in context is not a span"
    again = out["again"]
    assert again["prepared"] == 1, "the refused span computed alone"
    assert max_diff(hf_model, again) < TOL
    broken = result["unkeyed"]  # the check can fail: an engine that keeps in-context KV under span keys
    assert broken["tier"]["failed_loads"] == 1 and any(any(c) for c in broken["span_blocks_cached"][1:])


@pytest.mark.vllm
@pytest.mark.slow  # a server start (~35 s): in make test, not make test-fast
def test_spanq_serve_on_a_compiled_tier_answers_from_it_as_the_engine_does(run, tmp_path):
    """`spanq serve --tier-dir` on the tier the run above left (its flipped block in place): its engine core loads
    the spans (none prepared), refuses the flipped block and computes it in context, and answers the query as the
    engine of the run did on the same tier (`corrupt_direct`). The span it refused is then prepared alone when the
    server is idle, and the tier holds it again (without that, it would stay out until a query found it cold). The
    server's cache probe (in the API server's process) asks the tier by the engine's own block hashes, not by the
    KV events' form of them (asked by those, every such query failed with a 500)."""
    import httpx

    from spanq_backend.cluster.policy import query_span_digests
    from spanq_backend.serving.generator import load_chat_tokenizer
    from spanq_backend.serving.models import resolve_model
    from spanq_integrations.query.spnl_json import to_json
    from tests.backend.tier_run import query
    from tests.servers import free_port, running_server

    result, _, folder = run
    (about,) = (folder / "tier").glob("*/namespace.json")  # written by the engines of the run
    assert json.loads(about.read_text())["model_name"] == "tiny-llama-s0", "what `spanq tier` names the model by"
    port = free_port()
    command = [sys.executable, "-m", "spanq_integrations.cli", "serve", "--model", "tiny", "--port", str(port),
               "--max-model-len", "2048", "--tier-dir", str(folder / "tier"), "--recompute", "0"]  # as the engines ran
    flipped = Path(result["flipped"])
    # vLLM's own engine mode on a CPU, as a user's shell starts it (the tests' other servers run the model runner in
    # the engine core's process): the model runner in a process of its own, apart from the scheduler, each with its
    # own index of the tier (in one process, the refused block's index entry went with the file; apart, the
    # scheduler offered the block again forever and the query never answered)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with running_server(command, tmp_path / "server.log", "spanq serve --tier-dir", env=env) as proc:
        url = f"http://127.0.0.1:{port}"

        def shown() -> dict[str, float]:
            text = httpx.get(f"{url}/metrics", timeout=30).text
            return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("spanq_")}

        # the tier's counters are on /metrics before any query (they appeared with the first query's answer)
        deadline = time.monotonic() + 30
        while "spanq_tier_loaded_blocks_total" not in (before := shown()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert before.get("spanq_tier_loaded_blocks_total") == 0, before
        call = query(list(reversed(DOCS))).model_copy(update={"model": "tiny"})
        answer = httpx.post(f"{url}/v1/query/execute", json=to_json(call), timeout=120)
        assert answer.status_code == 200, answer.text

        # the refused span is in neither the engine's cache nor the tier now: prepared alone when the server is
        # idle, which writes its blocks to the tier again (from the engine core's writer thread). /metrics shows
        # that write with no other query after it (it showed the engine's counters as the last query left them:
        # nothing saved, the query's request only loads).
        deadline = time.monotonic() + 60
        while (shown()["spanq_spans_prepared_total"] < 1 or not flipped.exists()
               or shown()["spanq_tier_saved_blocks_total"] < 1) and time.monotonic() < deadline:
            time.sleep(0.5)
        counts = shown()
        assert counts["spanq_tier_saved_blocks_total"] >= 1, counts
        # What a cluster's router reads: every span of the query is in the tier (the refused one written again),
        # by the digests the router computes from a query's body, and the folder's own id (shared by every engine
        # on it: the router pools their reports by it).
        held = httpx.get(f"{url}/v1/spans", timeout=30).json()
        assert set(query_span_digests(json.dumps(to_json(call)))) <= set(held["tier"]), held
        assert held["tier_id"] == (about.parent / "tier-id").read_text().strip(), held
    # Stopped (SIGTERM), it ends as it said it would, without the interpreter's teardown report of ~500 objects
    # "leaked" by the Triton bindings vLLM imports (nanobind's, 5-30 lines after "Application shutdown complete").
    stopped = (tmp_path / "server.log").read_text(errors="replace")
    assert "nanobind" not in stopped and "leaked instance" not in stopped, stopped[-3000:]
    assert proc.returncode == 0 and "Application shutdown complete" in stopped, stopped[-3000:]
    # three spans read from the tier; the refused one computed in context, then prepared alone (deferred)
    assert counts["spanq_spans_hit_total"] == 3 and counts["spanq_deferred_spans_total"] == 1
    assert counts["spanq_spans_prepared_total"] == 1
    assert counts["spanq_tier_loaded_blocks_total"] > 0 and counts["spanq_tier_failed_loads_total"] == 1
    store = tier.DiskTier(flipped.parents[2], flipped.parents[1].name)
    assert store.read(bytes.fromhex(flipped.stem)).layers, "the block is in the tier again, its checksum good"
    text = answer.json()["result"]["assistant"]["text"]
    tokenizer = load_chat_tokenizer(str(resolve_model("tiny")))
    assert text == tokenizer.decode(result["corrupt_direct"]["tokens"], skip_special_tokens=True)


def test_a_tier_folder_has_one_identity_for_every_reader_and_another_folder_another(tmp_path):
    """What a cluster's router pools replicas' tier reports by: every `DiskTier` of one folder (another process, a
    replica on a shared disk) says the same id, the first writer's; a folder elsewhere, another."""
    first, second = tier.DiskTier(tmp_path / "shared", "ns"), tier.DiskTier(tmp_path / "shared", "ns")
    assert first.identity == second.identity == tier.DiskTier(tmp_path / "shared", "ns").identity
    assert tier.DiskTier(tmp_path / "elsewhere", "ns").identity != first.identity
    assert len(first.identity) == 24 and not list((tmp_path / "shared" / "ns").glob(".tier-id*")), "no leftovers"


def test_a_stored_block_reads_back_and_a_corrupt_or_truncated_one_is_refused(tmp_path):
    store = tier.DiskTier(tmp_path, "ns")
    values = torch.randn(2, 3, 32, 8)
    h = bytes(range(32))
    store.write_later(h, tier.Block(64, [("layer.0", tuple(values.shape), str(values.dtype), values.numpy().tobytes())]))
    store.flush()
    assert store.holds(h) and tier.DiskTier(tmp_path, "ns").holds(h), "found again by a tier that reads the folder"
    block = store.read(h)
    assert block.position == 64
    _, shape, dtype, data = block.layers[0]
    assert dtype == str(values.dtype)
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=values.dtype).view(shape), values)
    path = store.path_of(h)
    whole = path.read_bytes()
    flipped = bytearray(whole)
    flipped[-100] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="checksum"):
        store.read(h)
    path.write_bytes(whole[:-100])
    with pytest.raises(ValueError, match="truncated"):
        store.read(h)
    path.write_bytes(whole[:8] + (2**32 - 1).to_bytes(4, "little") + whole[12:])  # a header length past the file
    with pytest.raises(ValueError, match="header is longer than the file"):
        store.read(h)


def test_a_block_is_read_into_its_engine_block_in_place_and_other_tokens_under_its_key_are_refused(tmp_path):
    """A load reads the file straight into the engine's block (and no other); a file under the block's key that
    holds another block's tokens (a key collision) is refused before anything is read — without the tokens
    checked, the other tokens' KV would be what the engine reads."""
    store = tier.DiskTier(tmp_path, "ns")
    cache = torch.zeros(4, 2, 3, 8)  # an engine layer of 4 blocks
    values = torch.randn(2, 3, 8)
    h = bytes(range(32))
    store.write_later(h, tier.Block(16, [("layer.0", (2, 3, 8), str(values.dtype), values.numpy().tobytes())], (5, 6, 7)))
    store.flush()
    arrays = tier.layer_arrays([("layer.0", cache)])
    store.open_block(h).copy_into(arrays, 2, store._verified, (5, 6, 7))
    assert torch.equal(cache[2], values) and not cache[[0, 1, 3]].any()
    with pytest.raises(ValueError, match="key collision"):
        store.open_block(h).copy_into(arrays, 1, store._verified, (5, 6, 8))
    assert not cache[1].any(), "nothing read into the block"
    store.open_block(h).copy_into(arrays, 1, store._verified, None)  # tokens unchecked: served
    assert torch.equal(cache[1], values)
    with pytest.raises(ValueError, match="not the engine's"):  # another layout: refused, not read
        store.open_block(h).copy_into(tier.layer_arrays([("layer.0", torch.zeros(4, 2, 3, 4))]), 0, store._verified)
    with pytest.raises(tier.TierError, match="not contiguous"):
        tier.layer_arrays([("layer.0", torch.zeros(2, 4, 3, 8).transpose(0, 1))])


def evicted(tmp_path, pin: bool, load: bool) -> list[int]:
    """Four blocks written a second apart (0 oldest); block 0 pinned (`pin`), block 1 loaded since (`load`); then a
    capacity of 4.5 blocks and a fifth block written: which blocks the tier removed."""
    store = tier.DiskTier(tmp_path / f"{pin}{load}", "ns")
    hashes = [bytes([i]) * 32 for i in range(5)]

    def write(h):
        store.write_later(h, tier.Block(0, [("layer.0", (250,), "torch.float32", b"\0" * 1000)]))
        store.flush()

    for i, h in enumerate(hashes[:4]):
        write(h)
        os.utime(store.path_of(h), (1000 + i, 1000 + i))
    if pin:
        store.pin([hashes[0]])
    if load:
        store.used(hashes[1])
    store.max_bytes = int(store.path_of(hashes[0]).stat().st_size * 4.5)
    write(hashes[4])
    assert store.stats.evicted_blocks == 1 and store.bytes_held <= store.max_bytes
    return [i for i, h in enumerate(hashes) if not store.holds(h)]


def test_past_its_capacity_the_tier_removes_the_least_recently_used_block_and_never_a_pinned_one(tmp_path):
    assert evicted(tmp_path, pin=True, load=True) == [2]
    assert evicted(tmp_path, pin=False, load=True) == [0], "unpinned, the oldest goes first"
    assert evicted(tmp_path, pin=True, load=False) == [1], "a block loaded since counts as used then, not written then"
    with pytest.raises(tier.TierError, match="capacity"):
        tier.DiskTier(tmp_path, "ns", max_bytes=0)


def test_a_tier_setting_out_of_range_or_without_a_tier_is_refused_before_an_engine_starts():
    from spanq_backend.serving.engine import EngineConfig

    with pytest.raises(ValueError, match="give tier_dir too"):
        EngineConfig(tier_pin=True)
    with pytest.raises(ValueError, match="positive number of bytes"):
        EngineConfig(tier_dir="tier", tier_max_bytes=0)


def test_a_file_under_another_blocks_name_is_refused(tmp_path):
    store = tier.DiskTier(tmp_path, "ns")
    a, b = bytes(32), bytes([1] * 32)
    store.write_later(a, tier.Block(0, [("layer.0", (1,), "torch.float32", b"\0\0\0\0")]))
    store.flush()
    store.path_of(b).parent.mkdir(exist_ok=True)
    store.path_of(b).write_bytes(store.path_of(a).read_bytes())
    with pytest.raises(ValueError, match="another block"):
        store.read(b)


def test_a_tier_folder_that_cannot_be_written_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(tier.TierError, match="cannot be written"):
        tier.check_tier_dir(blocker / "tier")
    with pytest.raises(tier.TierError, match="is a file, not a folder"):  # ("cannot be written: File exists")
        tier.check_tier_dir(blocker)


def test_an_engine_with_a_tier_is_alone_in_its_process():
    engines = InProcessEngines()
    engines.starting()
    with pytest.raises(RuntimeError, match="only vLLM engine in its process"):
        engines.starting(tier=True)
    engines2 = InProcessEngines()
    engines2.starting(tier=True)
    with pytest.raises(RuntimeError, match="span tier is running in this process"):
        engines2.starting()


def test_a_corpus_line_that_is_not_a_document_is_named(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"one"\n\n{"text": "two"}\n[1, 2]\n{"page_content": ""}\n"lone \\ud800 half"\n')
    texts, problems = read_corpus(corpus)
    assert texts == ["one", "two"]
    assert [p.split(": ")[0] for p in problems] == [f"{corpus}:4", f"{corpus}:5", f"{corpus}:6"]
    # (JSON allows an escaped lone surrogate: no tokenizer reads it; `spanq prepare` failed on it with the
    # tokenizer's TypeError once the engine had started, and compiled nothing)
    assert problems[2].endswith("not valid Unicode text (a lone surrogate at index 5)")
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"text": "x"}, 3]))
    assert read_corpus(array) == (["x"], [f"{array}: item 1: not a document (a string, or an object with one of text, page_content, content)"])
    # A JSON line that is not UTF-8 is named by its line, and the rest read (one such line refused the whole
    # corpus, by a byte offset)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'"one"\n"caf\xe9 au lait"\n\xff\xfe\x00bad\n{"text": "two"}\n')
    assert read_corpus(binary) == (["one", "two"], [f"{binary}:2: not UTF-8 text (invalid continuation byte at column 5)",
                                                   f"{binary}:3: not UTF-8 text (invalid start byte at column 1)"])
    binary.write_bytes(b'[\n"one",\n"caf\xe9"\n]\n')  # one JSON array: read whole or not at all
    with pytest.raises(ValueError, match=f"cannot read {re.escape(str(binary))}: line 3 is not UTF-8 text"):
        read_corpus(binary)  # (the decoder's message named no file)


def test_the_eviction_warning_says_a_pinned_corpus_stays():
    """Blocks removed to keep a tier within --tier-max-gb: without --pin the corpus's own may be among them (a
    warning); with --pin they were others (its blocks are pinned), which the warning said were the corpus's."""
    from spanq_backend.serving.prepare import eviction_message

    assert eviction_message(0, 1.0, False) is None
    assert "this corpus's first documents too" in eviction_message(3, 0.5, False)
    pinned = eviction_message(3, 0.5, True)
    assert "first documents" not in pinned and "warning" not in pinned
    assert "3 unpinned blocks were removed" in pinned and "pinned and stay" in pinned


def test_spanq_serve_takes_a_tier_folder_as_its_kv_connector_and_refuses_what_cannot_work(tmp_path):
    from spanq_backend.serving.server import parse_serve_args

    args = parse_serve_args(["--model", "tiny", "--tier-dir", str(tmp_path / "tier")])
    config = args.kv_transfer_config
    assert config.kv_connector == "SpanTierConnector" and config.kv_connector_module_path == tier.__name__
    assert config.kv_connector_extra_config == {"tier_dir": str(tmp_path / "tier")}
    assert parse_serve_args(["--model", "tiny"]).kv_transfer_config is None, "no tier unless asked"
    capped = parse_serve_args(["--model", "tiny", "--tier-dir", str(tmp_path / "tier"), "--tier-max-gb", "2.5"])
    assert capped.kv_transfer_config.kv_connector_extra_config["max_bytes"] == 2_500_000_000
    with pytest.raises(ValueError, match="capacity"):
        parse_serve_args(["--model", "tiny", "--tier-dir", str(tmp_path / "tier"), "--tier-max-gb", "0"])
    # a negative number after an option (vLLM's parser read "-1.5" as an option of its own: "unrecognized arguments")
    with pytest.raises(ValueError, match="capacity.*got -1.5"):
        parse_serve_args(["--model", "tiny", "--tier-dir", str(tmp_path / "never"), "--tier-max-gb", "-1.5"])
    assert not (tmp_path / "never").exists(), "a usage error made the tier folder"
    with pytest.raises(SystemExit):  # argparse's usage error, naming the option (an IndexError inside vLLM's parser)
        parse_serve_args(["--recompute", "-0.1", "--model", "tiny"])
    with pytest.raises(ValueError, match="give --tier-dir too"):
        parse_serve_args(["--model", "tiny", "--tier-max-gb", "1"])
    with pytest.raises(ValueError, match="--kv-transfer-config"):
        parse_serve_args(["--model", "tiny", "--tier-dir", str(tmp_path / "tier"),
                          "--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'])
    (tmp_path / "file").write_text("")
    with pytest.raises(tier.TierError, match="cannot be written"):
        parse_serve_args(["--model", "tiny", "--tier-dir", str(tmp_path / "file" / "tier")])


def test_spanq_tier_lists_checks_and_clears_what_a_tier_holds(tmp_path, capsys, caplog):
    from spanq_backend.serving.tier_command import tier_main

    store = tier.DiskTier(tmp_path, "ns1", {"model": "abc" * 10, "model_name": "tiny-llama-s0", "dtype": "torch.float32",
                                           "block_size": 32, "vllm": "0.32.0"})  # fmt: skip
    good, broken = bytes(32), bytes([7] * 32)
    for h in (good, broken):
        store.write_later(h, tier.Block(0, [("layer.0", (2,), "torch.float32", b"\0" * 8)]))
    store.flush()
    store.pin([good])
    assert tier_main([str(tmp_path), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["namespace"] == "ns1" and listed["blocks"] == 2 and listed["dtype"] == "torch.float32"
    assert listed["pinned"] == 1 and listed["model_name"] == "tiny-llama-s0"
    assert tier_main([str(tmp_path)]) == 0  # the model by its name, beside the digest the folder is keyed by
    assert capsys.readouterr().out.startswith("ns1  model tiny-llama-s0 (abcabcabcabc…)  torch.float32  blocks of 32")
    data = bytearray(store.path_of(broken).read_bytes())
    data[-20] ^= 0xFF  # in the payload
    store.path_of(broken).write_bytes(bytes(data))
    assert tier_main([str(tmp_path), "--check", "--json"]) == 1, "a block set aside is the exit status 1"
    assert json.loads(capsys.readouterr().out) == {"good": 1, "set_aside": 1, "not_blocks": []}
    said = [r.getMessage() for r in caplog.records if "span tier: block" in r.getMessage()]
    assert len(said) == 1 and "fails its check" in said[0] and "computed instead" not in said[0], said
    assert not store.path_of(broken).exists() and store.path_of(broken).with_suffix(".bad").exists()
    assert tier_main([str(tmp_path), "--json"]) == 0 and json.loads(capsys.readouterr().out)[0]["set_aside"] == 1
    store.rescan()  # (as an engine reads the folder: the block is gone from it)
    store.write_later(broken, tier.Block(0, [("layer.0", (2,), "torch.float32", b"\0" * 8)]))  # computed again
    store.flush()
    assert tier_main([str(tmp_path), "--json"]) == 0  # (it was still listed as set aside beside its new file)
    assert json.loads(capsys.readouterr().out)[0]["set_aside"] == 0
    assert tier_main([str(tmp_path), "--clear", "other"]) == 2, "a namespace that is not there is named"
    assert "no namespace 'other'" in capsys.readouterr().err
    assert tier_main([str(tmp_path), "--clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": ["ns1"], "left_by_failed_clears": []} and not (tmp_path / "ns1").exists()
    assert tier_main([str(tmp_path / "missing")]) == 2


def test_spanq_tier_clear_before_its_folder_clears_that_folder(tmp_path, capsys):
    """`spanq tier --clear DIR`, the flag first: `--clear` may name a namespace, so it took the folder as one and
    the command said DIR was missing. The folder is the folder; `--clear NAMESPACE DIR` still names a namespace."""
    from spanq_backend.serving.tier_command import tier_main

    for ns in ("ns1", "ns2"):
        tier.DiskTier(tmp_path, ns, {"model": "abc"}).flush()
    assert tier_main(["--clear", "ns2", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == ["ns2"] and (tmp_path / "ns1").exists()
    assert tier_main(["--clear", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == ["ns1"] and not (tmp_path / "ns1").exists()
    assert tier_main(["--clear"]) == 2 and "required: DIR" in capsys.readouterr().err


def _stored(tmp_path, parts=None) -> tuple[tier.DiskTier, bytes]:
    store = tier.DiskTier(tmp_path, "ns", parts)
    h = bytes(range(32))
    store.write_later(h, tier.Block(16, [("layer.0", (2, 4), "torch.float32", b"\1" * 32)], (5, 6)))
    store.flush()
    return store, h


def _with_header(path: Path, header: bytes) -> None:
    """The block file at `path` with another header (same length, padded with spaces: the checksum is left)."""
    whole = path.read_bytes()
    start = len(tier.MAGIC) + 4
    length = int.from_bytes(whole[len(tier.MAGIC):start], "little")
    assert len(header) <= length
    path.write_bytes(whole[:start] + header.ljust(length) + whole[start + length:])


@pytest.mark.parametrize("header", [b"null", b"[1, 2]", b"{}", b'{"namespace": "ns", "hash": "%s"}',
                                    b'{"namespace": "ns", "hash": "%s", "position": "x", "layers": []}',
                                    b'{"namespace": "ns", "hash": "%s", "position": 0, "layers": [[1, 2]]}',
                                    b'{"namespace": "ns", "hash": "%s", "position": 0, "layers": 7}'])
def test_a_header_that_reads_as_json_but_not_as_a_block_is_refused_as_a_corrupt_file(tmp_path, header):
    """A flipped bit can leave a header that is JSON without being a block's (a field renamed, a value of
    another type): refused as any corrupt file (`ValueError`, which a load turns into computing the span), not a
    KeyError or TypeError that would escape the engine's step and end the engine."""
    store, h = _stored(tmp_path)
    _with_header(store.path_of(h), header.replace(b"%s", h.hex().encode()))
    with pytest.raises(ValueError, match="header"):
        store.open_block(h)
    with pytest.raises(ValueError, match="header"):
        store.read(h)


def test_a_refused_block_is_not_offered_again_even_where_it_cannot_be_set_aside(tmp_path):
    """A block refused on load is moved aside (`.bad`); where that fails (here: a folder in the way of the
    move, as a read-only folder would), the tier must still not offer it again — else the request that loads
    it fails, is looked up again, is offered it again, and never runs. Written again, it is offered again."""
    store, h = _stored(tmp_path)
    blocker = store.path_of(h).with_suffix(".bad")
    blocker.mkdir()
    (blocker / "x").write_text("in the way")
    store.forget(h, "its checksum does not match")
    assert store.path_of(h).exists(), "the move aside failed, as intended here"
    assert not store.holds(h)
    store.write_later(h, tier.Block(16, [("layer.0", (2, 4), "torch.float32", b"\2" * 32)], (5, 6)))
    store.flush()
    assert store.holds(h) and store.stats.failed_saves == 0


def test_a_block_that_cannot_be_removed_does_not_stop_eviction(tmp_path):
    """The least recently used entry cannot be removed (here a folder under a block's name; on a real disk a
    file the process may not delete): eviction goes on to the next, keeps the capacity, and counts no save as
    failed."""
    store = tier.DiskTier(tmp_path, "ns")
    hashes = [bytes([i]) * 32 for i in range(5)]

    def write(h):
        store.write_later(h, tier.Block(0, [("layer.0", (4000,), "torch.float32", b"\0" * 16000)]))
        store.flush()

    for h in hashes[1:4]:
        write(h)
    stuck = store.path_of(hashes[0])
    stuck.mkdir(parents=True)
    (stuck / "x").write_bytes(b"\0" * 100)
    for i, h in enumerate(hashes[:4]):
        os.utime(store.path_of(h), (1000 + i, 1000 + i))
    size = store.path_of(hashes[1]).stat().st_size
    assert stuck.stat().st_size < 0.5 * size
    store.max_bytes = 4 * size - 1  # the fifth write goes past it; one block out brings it under 90% of it
    write(hashes[4])
    assert store.stats.failed_saves == 0 and store.stats.evicted_blocks == 1
    assert not store.holds(hashes[1]) and store.holds(hashes[4]) and stuck.exists()


def test_a_tier_cleared_under_a_running_engine_is_written_again(tmp_path):
    """`spanq tier --clear` while an engine runs: its next saves make the folder again (its namespace.json
    too), rather than failing every save until the engine restarts."""
    import shutil

    store, h = _stored(tmp_path, parts={"model": "m"})
    shutil.rmtree(store.dir)
    other = bytes([7]) * 32
    store.write_later(other, tier.Block(0, [("layer.0", (2, 4), "torch.float32", b"\3" * 32)]))
    store.flush()
    assert store.stats.failed_saves == 0 and store.holds(other) and not store.holds(h)
    assert json.loads((store.dir / "namespace.json").read_text()) == {"model": "m"}
    assert store.read(other).position == 0


def test_blocks_left_by_a_clear_that_raced_a_writer_stay_listed_and_clearable(tmp_path, capsys):
    """`spanq tier --clear` beside an engine saving blocks (found by a newcomer's review, 1 clear in 30): the
    removal took `namespace.json`, then failed on a block written meanwhile ("Directory not empty"), and left
    blocks no `spanq tier` listed, checked or cleared, while the engine went on writing there. Now the engine's
    next save writes `namespace.json` again, and a clear renames the namespace away before removing it."""
    from spanq_backend.serving.tier_command import tier_main

    store, _ = _stored(tmp_path, parts={"model": "m"})
    (store.dir / "namespace.json").unlink()  # what the failed clear left
    other = bytes([7]) * 32
    store.write_later(other, tier.Block(0, [("layer.0", (2, 4), "torch.float32", b"\3" * 32)]))
    store.flush()
    assert tier_main([str(tmp_path), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["blocks"] == 2, "the blocks of a namespace whose description was taken are listed again"
    assert tier_main([str(tmp_path), "--clear"]) == 0 and not store.dir.exists()
    assert not list(tmp_path.iterdir()), "nothing left behind, the renamed folder included"
    assert capsys.readouterr().out == f"removed 1 namespace(s) from {tmp_path}\n"
    store.write_later(bytes([8]) * 32, tier.Block(0, [("layer.0", (2, 4), "torch.float32", b"\1" * 32)]))
    store.flush()  # the engine writes on: the namespace is made again, listed
    assert store.stats.failed_saves == 0 and tier_main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["blocks"] == 1


def test_what_a_clear_that_failed_left_is_listed_and_removed_by_the_next_clear(tmp_path, capsys):
    """A clear renames a namespace away, then removes it; where a file could not be removed (a permission), the
    renamed folder stayed: `spanq tier` listed nothing, a second `--clear` said "removed 0" and left the blocks on
    disk (found by a newcomer's review). It is named now, and the next clear removes it."""
    from spanq_backend.serving.tier_command import tier_main

    store, _ = _stored(tmp_path, parts={"model": "m"})
    left = tmp_path / f".cleared-{store.dir.name}-1234-5678"
    store.dir.rename(left)  # what the failed clear left: renamed, its blocks still there
    assert tier_main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"{left}: left by a clear that failed (2 files" in captured.err and "--clear` removes it" in captured.err
    assert tier_main([str(tmp_path), "--clear", store.dir.name, "--json"]) == 0, "its namespace's name finds it"
    assert json.loads(capsys.readouterr().out) == {"removed": [], "left_by_failed_clears": [left.name]}
    assert not left.exists() and not list(tmp_path.iterdir())
    assert tier_main([str(tmp_path), "--clear"]) == 0
    assert capsys.readouterr().out == f"removed 0 namespace(s) from {tmp_path}\n"


def test_spanq_tier_names_a_file_that_is_no_block_and_a_damaged_description(tmp_path, capsys):
    """A `.kv` file not named by a block's hash crashed `--check` ("non-hexadecimal number found in fromhex()")
    and was counted as a block; a damaged `namespace.json` failed the listing with a JSONDecodeError naming no
    file, and no engine repaired it."""
    from spanq_backend.serving.tier_command import tier_main

    store, h = _stored(tmp_path, parts={"model": "m"})
    (store.path_of(h).parent / "notahash.kv").write_text("x")
    assert tier_main([str(tmp_path), "--check", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"good": 1, "set_aside": 0, "not_blocks": [str(store.path_of(h).parent / "notahash.kv")]}
    assert "notahash.kv: not named as a block (no engine reads it); left alone" in captured.err
    assert tier_main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["blocks"] == 1
    (store.dir / "namespace.json").write_text('{"model": ')
    assert tier_main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"{store.dir / 'namespace.json'} cannot be read (JSONDecodeError" in captured.err
    assert "1 blocks" in captured.out
    tier.DiskTier(tmp_path, "ns", {"model": "m"})  # an engine that starts on it writes it again
    assert json.loads((store.dir / "namespace.json").read_text()) == {"model": "m"}


def test_an_empty_document_in_a_corpus_is_named_as_empty(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"one"\n""\n{"text": "  "}\n7\n')
    texts, problems = read_corpus(corpus)
    assert texts == ["one"]
    assert problems == [f"{corpus}:2: an empty document (its text is blank)",
                        f"{corpus}:3: an empty document (its text is blank)",
                        f"{corpus}:4: not a document (a string, or an object with one of text, page_content, content)"]


def test_a_corpus_line_keeps_unicode_line_separators_and_a_byte_order_mark_is_not_a_document(tmp_path):
    corpus = tmp_path / "c.jsonl"
    docs = ["one\u2028two", "form\x0cfeed and next\x85line", "third"]
    corpus.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(d, ensure_ascii=False) for d in docs).encode()
                       + b"\n[bad\n")
    texts, problems = read_corpus(corpus)
    assert texts == docs
    assert [p.split(": ")[0] for p in problems] == [f"{corpus}:4"]


def test_blocks_past_the_writers_backlog_are_not_saved_and_a_flush_says_when_it_gave_up(tmp_path):
    """Each block waiting for the writer is a copy in memory: past `MAX_PENDING_BYTES` a block is not saved
    (counted, said once) rather than memory growing with a disk slower than the engine."""
    store = tier.DiskTier(tmp_path, "ns")
    store.MAX_PENDING_BYTES = 40  # under one block: every save is past the backlog
    for i in range(3):
        store.write_later(bytes([i]) * 32, tier.Block(0, [("layer.0", (16,), "torch.float32", b"\0" * 64)]))
    assert store.flush() is True
    assert store.stats.failed_saves == 3 and store.stats.saved_blocks == 0 and len(store) == 0
    store.MAX_PENDING_BYTES = 1 << 20
    store.write_later(bytes([9]) * 32, tier.Block(0, [("layer.0", (16,), "torch.float32", b"\0" * 64)]))
    assert store.flush(timeout=None) is True and store.holds(bytes([9]) * 32)
