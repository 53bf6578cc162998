"""Bulk span queries on Ray Data: `run_bulk` and `spanq run --bulk` over two span engines (tiny model)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from spanq_integrations import cross, execute, fragment, generate, plus, system, user
from spanq_integrations.optimizer.bulk_order import partition_by_fragments
from spanq_integrations.query.ir import Fragment, walk
from spanq_integrations.query.spnl_json import to_json

pytest.importorskip("ray.data", reason="the cluster extra: pip install 'spanq[cluster]'")

WORDS = ["key", "door", "lamp", "road", "tree", "bell", "cup"]
DOCS = [f"Document {i}. " + " ".join(f"The {w} of {i} is {j}." for j, w in enumerate(WORDS * 3)) for i in range(8)]


def rag(docs: list[str], question: str = "Which door?", max_tokens: int = 4):
    return generate(
        cross(system("Answer from the documents."), plus(*[fragment(d) for d in docs]), user(question)),
        max_tokens=max_tokens,
        temperature=0.0,
    )


def batch(n: int) -> list:
    """Queries over two pools of four documents (even queries read pool 0, odd ones pool 1), three each."""
    pools = [DOCS[:4], DOCS[4:]]
    return [rag([pools[i % 2][(i + k) % 4] for k in range(3)], question=f"Which door? ({i})") for i in range(n)]


def pools_per_group(queries: list, groups: list[list[int]]) -> list[set[int]]:
    """Which pools of documents each group of queries reads, from the queries' own fragments."""
    pool_of = {doc: 0 if doc in DOCS[:4] else 1 for doc in DOCS}
    return [{pool_of[n.text] for i in g for _, n in walk(queries[i]) if isinstance(n, Fragment)} for g in groups]


def test_partitions_keep_queries_that_share_fragments_together():
    queries = batch(16)
    groups = partition_by_fragments(queries, 2)
    assert sorted(i for g in groups for i in g) == list(range(16))
    assert pools_per_group(queries, groups) in ([{0}, {1}], [{1}, {0}])
    assert partition_by_fragments(queries, 2) == groups  # deterministic
    assert max(len(g) for g in partition_by_fragments(queries, 3)) <= 7  # balanced within the slack
    assert partition_by_fragments([], 2) == [] and partition_by_fragments(queries[:1], 4) == [[0]]


def test_a_split_that_ignores_fragments_fails_the_check():
    """The check above can fail: a partitioner that cuts the batch into runs in input order (ignoring the
    queries' fragments) puts both pools on both engines, and the same check says so."""
    def in_input_order(queries, parts):
        size = -(-len(queries) // parts)
        return [list(range(k, min(k + size, len(queries)))) for k in range(0, len(queries), size)]

    queries = batch(16)
    groups = in_input_order(queries, 2)
    assert sorted(i for g in groups for i in g) == list(range(16))  # a valid split…
    assert pools_per_group(queries, groups) not in ([{0}, {1}], [{1}, {0}])  # …that the check rejects


@pytest.mark.slow
@pytest.mark.vllm
def test_64_queries_over_two_engines_answer_as_one_engine_in_input_order(tiny_backend):
    import ray

    from spanq_backend.cluster.bulk import run_bulk
    from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE

    queries = batch(64)
    queries[10] = generate(user("word " * 9000), max_tokens=4)  # over the context window: fails alone
    assert not ray.is_initialized(), "a test before this one left Ray running in the test process"
    items = list(run_bulk(queries, actors=2, model="tiny"))
    assert not ray.is_initialized(), "run_bulk left the Ray it started running (everything after it runs slower)"
    assert [item.index for item in items] == list(range(64))
    assert not items[10].ok and items[10].error.startswith("ContextLengthError: ")
    ok = [item for item in items if item.ok]
    assert len(ok) == 63
    assert {item.partition for item in ok} == {0, 1}
    # each engine prepared only its pool's documents, each once
    assert sum(item.usage["prepared_spans"] for item in ok) == len(DOCS)
    # (the bulk engines run at the engines' default recompute setting; the session's tiny backend recomputes
    # nothing unless a query says so)
    expected = [execute(q.model_copy(update={"recompute": DEFAULT_RECOMPUTE}), backend=tiny_backend).answer
                for q in queries[:12] if q is not queries[10]]  # fmt: skip
    assert [item.answer for item in items[:12] if item.index != 10] == expected


@pytest.mark.slow
@pytest.mark.vllm
def test_spanq_run_bulk_names_a_malformed_line_and_runs_the_rest(tmp_path: Path):
    """The command line over a file (one engine: two, and how they share the work, are the test above's), through
    the command's own entry point in this process, on a Ray this process joined before: left running for it."""
    import ray

    from spanq_backend.cluster.connect import connect
    from spanq_integrations.cli import main

    lines = [json.dumps(to_json(q)) for q in batch(4)]
    lines.insert(1, '{"g": {"input": {"usr": "typo"}}}')
    lines.insert(3, "")
    path = tmp_path / "queries.jsonl"
    path.write_text("\n".join(lines) + "\n")
    stdout, stderr = io.StringIO(), io.StringIO()
    connect(None)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["run", "--bulk", str(path), "--model", "tiny", "--actors", "1"])
        assert ray.is_initialized(), "the caller's Ray was stopped under it"
    finally:
        ray.shutdown()
    assert code == 1, stderr.getvalue()[-2000:]
    out = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert [(o["index"], o["line"]) for o in out] == [(0, 1), (1, 2), (2, 3), (3, 5), (4, 6)]
    assert out[1]["error"].startswith('line 2: $.g.input: unknown node "usr"')
    assert all(o.get("answer") for k, o in enumerate(out) if k != 1)
    assert "1 of 5 queries failed" in stderr.getvalue()


def test_spanq_run_bulk_on_a_ray_of_its_own_prints_answers_not_rays_chatter(tmp_path: Path):
    """On a Ray it starts for the batch, the command's stderr is not Ray's: no notice on token authentication (a
    Ray of this process's own, stopped with it), no Ray Data INFO lines on each run, no warning that progress bars
    are off. (Ray's core still writes one line for its actor pool: C++, beyond Python's logging.) Without --model
    the engines run the model the queries name, as `spanq run` of one query does, written as spnl writes it
    ("spnl/tiny"): they ran on the default model, whatever the queries named."""
    import subprocess
    import sys

    from spanq_integrations.cli import with_model

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(to_json(with_model(q, "spnl/tiny"))) + "\n" for q in batch(2)))
    done = subprocess.run([sys.executable, "-m", "spanq_integrations.cli", "run", "--bulk", str(path),
                           "--actors", "1"], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = [json.loads(line) for line in done.stdout.splitlines()]
    assert [o["index"] for o in out] == [0, 1]
    assert {c["model"] for o in out for c in o["calls"]} == {"tiny-llama-s0"}, out
    for chatter in ("Token authentication", " INFO ", "Progress bars disabled", "Starting execution of Dataset"):
        assert chatter not in done.stderr, done.stderr


def test_bulk_flags_that_cannot_work_are_one_line_errors(tmp_path: Path):
    import http.server
    import threading

    from tests.commands import run_in_one_process

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(to_json(batch(1)[0])) + "\n")
    # a web server where a Ray address was meant: Ray's own join would wait minutes on it
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    web_address = f"127.0.0.1:{web.server_port}"
    cases = [
        (["--actors", "0"], "--actors must be at least 1, got 0"),
        (["--backend", "http://127.0.0.1:9"], "--bulk runs on a pool of embedded span engines"),
        (["--ray-address", "ray://127.0.0.1:1"], "the Ray cluster at 'ray://127.0.0.1:1' does not answer"),
        (["--ray-address", web_address], f"{web_address!r} is not a Ray cluster: something listens there"),
    ]
    try:
        done = run_in_one_process([["run", "--bulk", str(path), *flags] for flags, _ in cases], timeout=120)
    finally:
        web.shutdown()
    for (flags, message), (code, stderr) in zip(cases, done, strict=True):
        assert code == 2, (flags, stderr)
        assert stderr.strip().splitlines()[-1].startswith(f"spanq: error: {message}"), (flags, stderr)


def test_a_bulk_runs_the_one_model_its_queries_name(capsys):
    """The model of a bulk's engines without --model (the command above runs it end to end): the one the calls
    name, a provider of spnl's dropped; "default" where they name none, or one the embedded engine cannot start
    (said); calls that name two models are refused, since every engine of a bulk runs one."""
    from spanq_integrations.cli import CommandError, _bulk_model, with_model

    queries = batch(2)
    assert _bulk_model(queries) == "default"
    assert _bulk_model([with_model(q, "tiny") for q in queries]) == "tiny"
    assert _bulk_model([with_model(q, "openai/tiny") for q in queries]) == "tiny"
    assert _bulk_model([with_model(queries[0], "spnl/tiny"), with_model(queries[1], "tiny")]) == "tiny"  # one model
    assert _bulk_model([with_model(queries[0], "gpt-4o"), queries[1]]) == "default"
    assert "the queries name model 'gpt-4o', which the embedded engine cannot start" in capsys.readouterr().err
    with pytest.raises(CommandError, match=r"the queries name 2 models \(gpt-4o, tiny\).*pass --model"):
        _bulk_model([with_model(queries[0], "tiny"), with_model(queries[1], "gpt-4o")])
