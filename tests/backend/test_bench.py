"""`spanq bench`: every benchmark runs at its smallest size, prints its table, and writes JSON and a PNG with the
fields docs/benchmarks.md describes into its --out folder. The benchmarks that need engines share one pair
(stock + spans) on the tiny model and are marked slow; the rest (dispatch, options, the shared report, workloads,
statistics, ReRoPE, haystack on a scripted judge, the HF span reference) are quick."""

from __future__ import annotations

import ast
import importlib
import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

import benchmarks
from benchmarks import BENCHMARKS, bench_main
from benchmarks.common import (
    LABEL_ENV,
    BenchReport,
    base_parser,
    environment,
    format_table,
    make_documents,
    new_figure,
    percentile,
    summarize,
)
from spanq_integrations.backends.protocol import Backend, BackendCapabilities, CallMetrics, Completion
from spanq_integrations.query.flatten import to_chat_messages


def read_report(out: Path, stem: str, printed: str | None = None) -> dict:
    """The report `<out>/<stem>.json` (with its plot beside it); `printed`: the benchmark's stdout, which must name
    both files."""
    path = out / f"{stem}.json"
    assert path.is_file(), f"no {path.name} in {sorted(p.name for p in out.iterdir())}"
    assert (out / f"{stem}.png").stat().st_size > 1000
    if printed is not None:
        assert f"wrote {path} and {out / f'{stem}.png'}" in printed
    report = json.loads(path.read_text())
    assert {"benchmark", "config", "environment", "rows", "summary"} <= set(report)
    assert report["config"]["out"] == str(out)
    assert report["environment"]["spanq"] == spanq_version()
    assert "git_commit" not in report["environment"]
    assert report["rows"], "the benchmark measured nothing"
    return report


def spanq_version() -> str:
    import spanq_integrations

    return spanq_integrations.__version__


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from spanq_backend.serving.generator import load_chat_tokenizer

    return load_chat_tokenizer(tiny_model)


# --------------------------------------------------------------------------------------------- dispatch


def test_bench_lists_every_benchmark_and_refuses_unknown_ones(capsys):
    assert bench_main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ("rag", "nested", "bulk", "quality", "rerope", "haystack"):
        assert name in BENCHMARKS and name in listed
    assert bench_main([]) == 2
    missing = capsys.readouterr()
    assert missing.out == "" and "usage: spanq bench NAME" in missing.err  # (a usage error, on stderr as the others)
    assert bench_main(["no-such-bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_spanq_cli_delegates_to_the_benchmarks(capsys):
    from spanq_integrations.cli import main

    assert main(["bench", "--help"]) == 0
    assert "rerope" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- plumbing


def test_every_benchmark_takes_out_defaulting_to_results_under_the_current_directory(tmp_path):
    for name, (module_name, _) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        assert module.parse_args([]).out == Path("results") / name, name
        args = module.parse_args(["--out", str(tmp_path / "x"), "--tag", "t"])
        assert (args.out, args.tag) == (tmp_path / "x", "t"), name
        assert BenchReport(name, args).json_path.parent == tmp_path / "x"


def test_report_writes_into_out_prints_what_it_wrote_and_records_version_and_label(tmp_path, monkeypatch, capsys):
    real_popen = subprocess.Popen

    def no_git(cmd, *args, **kwargs):
        program = cmd.split()[0] if isinstance(cmd, str) else str(next(iter(cmd)))
        assert Path(program).name != "git", f"a benchmark ran {cmd}"
        return real_popen(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", no_git)  # run, check_output, call go through Popen
    monkeypatch.setenv(LABEL_ENV, "nightly-7")
    args = base_parser("demo", "a demo").parse_args(["--out", str(tmp_path / "out"), "--tag", "t", "--reps", "2"])
    report = BenchReport("demo", args, rows=[{"x": 1.0, "nan": float("nan")}], summary={"n": 1})
    path = report.write()
    assert path == tmp_path / "out" / "demo-tiny-t.json" and report.written == [path]
    report.print_files()
    # Which code ran, by the folder it was imported from: a run meant for a worktree's older code that imported
    # this checkout's says so (tests/backend/test_bench.py is this checkout's: the code under test is beside it).
    here = str(Path(__file__).resolve().parents[2])
    assert capsys.readouterr().out == f"\nwrote {path} (spanq from {here})\n"
    payload = json.loads(path.read_text())
    assert payload["benchmark"] == "demo" and payload["rows"] == [{"x": 1.0, "nan": None}]
    assert payload["config"]["out"] == str(tmp_path / "out") and payload["config"]["reps"] == 2
    env = payload["environment"]
    assert env["spanq"] == spanq_version() and env["label"] == "nightly-7" and env["bench_seconds"] >= 0
    assert not any("git" in key for key in env) and env["code"] == here

    figure, (ax,) = new_figure(1)
    ax.plot([1, 2], [3, 4])
    assert BenchReport("demo", args, label="").write(figure) == tmp_path / "out" / "demo-t.json"
    assert (tmp_path / "out" / "demo-t.png").stat().st_size > 1000

    monkeypatch.delenv(LABEL_ENV)
    assert "label" not in environment()


def test_no_benchmark_calls_git_or_subprocess():
    for path in Path(benchmarks.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "subprocess" for a in node.names), path.name
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] != "subprocess", path.name
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value.split()[:1] != ["git"], f"{path.name}: {node.value!r}"


def test_documents_are_deterministic_distinct_and_within_their_token_budget(tokenizer):
    docs = make_documents(tokenizer, 6, 80, seed=3)
    assert docs == make_documents(tokenizer, 6, 80, seed=3)
    assert len(set(docs)) == 6
    assert make_documents(tokenizer, 2, 80, seed=4) != docs[:2]
    sizes = [len(tokenizer.encode(d, add_special_tokens=False)) for d in docs]
    assert all(60 <= n <= 80 for n in sizes), sizes


def test_statistics_and_table():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2], 90) == pytest.approx(1.9)
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"], s["mean"]) == (4, 2.5, 1.0, 4.0, 2.5)
    assert summarize([])["n"] == 0
    table = format_table(["name", "ms"], [["a", 1.23456], ["bb", float("nan")]])
    assert table.splitlines()[2].split() == ["a", "1.23"] and table.splitlines()[3].split() == ["bb", "-"]


def test_bulk_workload_is_skewed_deterministic_and_ordered_for_locality(tokenizer):
    from benchmarks.bulk import bulks, make_workload

    opts = {"pool": 40, "queries": 60, "k": 3, "frag_tokens": 24, "zipf": 1.1, "seed": 5}
    w = make_workload(tokenizer, **opts)
    assert w == make_workload(tokenizer, **opts)
    assert all(len(q) == 3 == len(set(q)) for q in w.queries)
    reads = [f for q in w.queries for f in q]
    assert reads.count(0) > 3 * max(1, reads.count(30)), "fragment 0 is the most popular"
    arrival = [b for batch in bulks(w, 20, "arrival", 1) for b in batch]
    local = bulks(w, 20, "locality", 1)
    assert [len(b) for b in local] == [20, 20, 20]
    assert sorted(map(repr, arrival)) == sorted(repr(q) for b in local for q in b), "a permutation per bulk"
    # The careful stock user's baseline: the same fragments, sorted into one canonical order in every query.
    canonical = [b for batch in bulks(w, 20, "arrival", 1, canonical=True) for b in batch]
    for plain, sorted_query in zip(arrival, canonical):
        ids = [c.id for c in sorted_query.input.children[1].children]
        assert ids == sorted(ids, key=lambda i: int(i.removeprefix("frag")))
        assert sorted(ids) == sorted(c.id for c in plain.input.children[1].children)


def test_benches_run_at_the_engines_recompute_unless_told():
    """`spanq bench rag|nested|bulk --recompute SETTING` (the tables before the default became "question" were measured at 0);
    a bad setting is the flag's error, before any engine starts."""
    from benchmarks import bulk, nested, rag
    from benchmarks.common import engine_options_of

    for bench in (rag, nested, bulk):
        assert bench.parse_args([]).recompute is None
        assert engine_options_of(bench.parse_args([]), max_num_seqs=4) == {"max_num_seqs": 4}
        args = bench.parse_args(["--recompute", "0"])
        assert args.recompute == 0 and engine_options_of(args, max_num_seqs=4) == {"max_num_seqs": 4, "recompute": 0}
        assert bench.parse_args(["--recompute", "first"]).recompute == "first"
        with pytest.raises(SystemExit):
            bench.parse_args(["--recompute", "most"])


def test_quality_items_hold_their_answer_in_exactly_one_document():
    from benchmarks.quality import make_items, names_color

    items = make_items(5, 4, seed=1)
    assert items == make_items(5, 4, seed=1)
    for item in items:
        assert len(item.docs) == 4 and item.color in item.docs[item.target]
        holders = [d for d in item.docs if f"{item.town} is a small town" in d]
        assert holders == [item.docs[item.target]]
        assert names_color(item.gold, item.color)
    assert not names_color("It is painted redwood.", "red")


def test_a_judge_item_is_right_when_its_pick_is_not_when_it_names_the_number_somewhere():
    """The judge task's exact match reads the candidate the answer picks (its first number), not any mention of
    the right number: "1. ... painted blue" picks 1, "The answer 4 is correct" picks 4."""
    from benchmarks.quality import judge_pick, make_task_items

    item = next(it for it in make_task_items("judge", 10, 5, seed=0) if it.target == 0)
    assert item.correct("The answer 1 is correct.") and item.correct("1")
    assert not item.correct("The answer 4 is correct, not 1.")  # names 1, picks 4
    assert not item.correct("None of them.")
    assert judge_pick("Answer 3: the town hall is painted 2 colours") == 3 and judge_pick("12 answers") is None


def test_hf_span_reference_behaves_as_span_attention(tiny_model):
    """bench/hf_span.py (also the tests' reference): no spans is full attention; spans change the numbers;
    a stand-alone span differs from one after the anchor; a prompt may end with a span; KL is sane."""
    import torch

    from benchmarks import hf_span

    model = hf_span.load_hf_model(tiny_model)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 5000) for _ in range(172)]
    spans = [(32, 64), (64, 128), (128, 160)]
    cont = [11, 12, 13]
    full = hf_span.full_attention_next_token_logprobs(model, ids, cont)
    torch.testing.assert_close(hf_span.span_attention_next_token_logprobs(model, ids, [], cont), full)
    span = hf_span.span_attention_next_token_logprobs(model, ids, spans, cont)
    assert float((span - full).abs().max()) > 1e-3
    alone = hf_span.span_reference_logprobs(model, ids, spans, cont, anchors=[32, 0, 32])
    assert float((alone - hf_span.span_reference_logprobs(model, ids, spans, cont)).abs().max()) > 1e-4
    ends = hf_span.span_reference_logprobs(model, ids[:160], spans, cont)
    assert ends.shape == (3,) and bool(torch.isfinite(ends).all())
    kl = hf_span.kl_divergence(full, span)
    assert kl.shape == (3,) and bool((kl >= -1e-9).all()) and float(kl.max()) > 0
    assert float(hf_span.kl_divergence(full, full).abs().max()) < 1e-9


# --------------------------------------------------------------------------------------------- rerope (torch)


def test_rerope_bench_writes_throughput_beside_a_copy_and_planning_cost(tmp_path, capsys):
    from benchmarks.rerope import main

    argv = ["--shapes", "tiny", "--moved", "4", "--reps", "2", "--num-blocks", "32", "--no-decode",
            "--requests", "4", "--spans", "4", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "tok/ms" in printed
    report = read_report(tmp_path, "rerope-tiny", printed)
    assert {r["pattern"] for r in report["rows"]} == {"scattered", "runs"}
    for row in report["rows"]:
        assert row["relocate_tokens_per_ms"] > 0 and row["copy_tokens_per_ms"] > 0
        assert row["fraction_of_copy"] > 0 and row["tokens"] == 4 * 32
    assert report["summary"]["max_abs_error_vs_rerope"] < 1e-4
    planning = report["summary"]["planning"]
    assert planning["requests"] == 4 and planning["total_us_per_step"] > 0


# --------------------------------------------------------------------------------------------- haystack


class PerfectJudge(Backend):
    """Answers every judge call with each hidden name it reads (a name from haystack's pools), one per line."""

    capabilities = BackendCapabilities(name="perfect-judge", max_concurrency=8)

    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    async def generate(self, call, *, path="$", on_token=None):
        from benchmarks.haystack import FIRST_NAMES, LAST_NAMES

        self.calls += 1
        body = "\n".join(m["content"] for m in to_chat_messages(call.input))
        names = dict.fromkeys(
            m for m in re.findall(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b", body)
            if m.split()[0] in FIRST_NAMES and m.split()[1] in LAST_NAMES
        )
        text = "\n".join(names)
        labelled = dict(re.findall(r"^\[(\d+)\] (.*)$", body, re.MULTILINE))  # select: "[i] text" blocks
        hiding = [label for label, t in labelled.items() if any(name in t for name in names)]
        if "Rate every candidate" in body:  # a scoring leaf: 10 for the text hiding a name, 0 for the others
            text = "\n".join(f"[{label}] {10 if label in hiding else 0}" for label in labelled)[1:]
        elif "label of the best candidate" in body:  # a tournament judge: the hiding one's label (and text)
            best = hiding[0] if hiding else next(iter(labelled), "0")
            text = f"{best}]" if path == "$" else f"[{best}] {labelled.get(best, '')}"
        metrics = CallMetrics(path=path, model="perfect", prompt_tokens=len(body.split()),
                              generated_tokens=len(text.split()), wall_s=0.001)
        return Completion(texts=[text], metrics=metrics)

    async def aclose(self) -> None:
        self.closed = True


def test_haystack_bench_writes_through_the_shared_report(tmp_path, monkeypatch, capsys):
    """haystack on a scripted judge (no model): the table, `<out>/haystack.json` in the shared layout, the plot,
    the printed paths; and, without --out, `results/haystack/` under the current directory."""
    from benchmarks import haystack

    judge = PerfectJudge()
    monkeypatch.setattr(haystack, "open_backend", lambda args: (judge, "", "a perfect scripted judge"))
    argv = ["--runs", "2", "--hay", "20,40", "--k", "2", "--docs", "4", "--names", "1", "--no-progress"]
    assert haystack.main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert judge.closed and judge.calls == 2 * 2 * (1 + 3 + 2)  # flat, the model tree, the leaves in code
    printed = capsys.readouterr().out
    assert "a perfect scripted judge" in printed and "12 judge runs" in printed
    table = printed.split("\n\n")[1].splitlines()
    assert table[0].split()[:2] == ["hay", "method"] and table[2].startswith("20   flat ")
    report = read_report(tmp_path / "out", "haystack", printed)
    assert report["benchmark"] == "haystack"
    assert report["config"]["backend_description"] == "a perfect scripted judge"
    assert report["config"]["instruction"] == haystack.INSTRUCTION and report["config"]["runs"] == 2
    methods = ("flat", "k=2 model", "k=2 code")
    assert len(report["rows"]) == 2 * 2 * 3
    assert {(r["hay"], r["method"]) for r in report["rows"]} == {(h, m) for h in (20, 40) for m in methods}
    assert all(r["error"] is None and r["recall"] == r["precision"] == 1.0 for r in report["rows"])
    assert [(p["hay"], p["method"], p["runs"]) for p in report["summary"]] == [
        (h, m, 2) for h in (20, 40) for m in methods
    ]
    assert {p["calls"] for p in report["summary"] if p["method"] == "k=2 model"} == {3.0}
    assert {p["calls"] for p in report["summary"] if p["method"] == "k=2 code"} == {2.0}

    monkeypatch.chdir(tmp_path)
    assert haystack.main([*argv, "--tag", "again"]) == 0
    out = Path("results") / "haystack"
    assert f"wrote {out / 'haystack-again.json'}" in capsys.readouterr().out
    again = json.loads((tmp_path / out / "haystack-again.json").read_text())
    def found(rows):
        return [(r["hay"], r["method"], r["run"], r["found"]) for r in rows]

    assert found(again["rows"]) == found(report["rows"]), "seeded haystacks: the same runs"
    assert haystack.main(["--k", "1", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()

    # --task select: one of 4 texts hides a name; a perfect judge names it flat, in a tournament, by scores
    capsys.readouterr()
    select = ["--task", "select", "--runs", "3", "--hay", "20", "--k", "2", "--docs", "4", "--no-progress"]
    assert haystack.main([*select, "--out", str(tmp_path / "select")]) == 0
    rows = read_report(tmp_path / "select", "haystack", capsys.readouterr().out)["rows"]
    assert {r["method"] for r in rows} == set(methods) and len(rows) == 9
    assert all(r["error"] is None and r["recall"] == r["leaf_recall"] == 1.0 for r in rows), rows


# --------------------------------------------------------------------------------------------- engine benches


@pytest.fixture(scope="module")
def engines(tiny_model):
    """The engine benchmarks' pair, shared by them: stock vLLM in its own process with the plugin off (as
    `engine_pair` starts it), the span-aware engine in this one."""
    from benchmarks.common import close_backend, start_pair

    stock, spans = start_pair(str(tiny_model), max_model_len=4096, max_num_seqs=8)
    yield stock, spans
    close_backend(spans)
    close_backend(stock)


@pytest.mark.slow  # a vLLM import and engine start in a process of its own (~20-50 s)
@pytest.mark.vllm
def test_the_baseline_is_stock_vllm_in_its_own_process(engines):
    """The baseline engine runs without spanq's plugin, in another process; it answers as the span engine does
    a prompt without spans, its errors reach the caller as spanq errors, and a closed one refuses calls."""
    import os

    from benchmarks.process_backend import ProcessBackend
    from spanq_integrations import (
        BackendUnavailableError,
        ContextLengthError,
        cross,
        execute,
        generate,
        system,
        user,
    )

    stock, spans = engines
    assert isinstance(stock, ProcessBackend) and stock.plugin is False and stock._proc.pid != os.getpid()
    assert not stock.capabilities.span_aware
    plain = generate(cross(system("Be brief. " * 20), user("Name a colour.")), max_tokens=8, temperature=0.0)
    result = execute(plain, stock)
    assert result.answer == execute(plain, spans).answer
    assert result.calls[0].ttft_s is not None and result.calls[0].prompt_tokens > 0
    with pytest.raises(ContextLengthError):
        execute(generate(user("word " * 5000), max_tokens=4), stock)
    again = execute(plain, stock)
    assert again.answer == result.answer, "an error does not take the engine down"
    assert again.calls[0].cached_tokens > 0
    from benchmarks.common import reset_cache

    reset_cache(stock)
    assert execute(plain, stock).calls[0].cached_tokens == 0, "the reset emptied the prefix cache"
    # Ctrl-C reaches the whole process group: the benchmark handles it (stops, closes its engines); the engine's
    # process printed its own two tracebacks (KeyboardInterrupt, "Event loop is closed") and died under it
    import signal
    import time

    os.kill(stock._proc.pid, signal.SIGINT)
    time.sleep(1.0)
    assert stock._proc.is_alive() and execute(plain, stock).answer == result.answer

    other = ProcessBackend.__new__(ProcessBackend)  # a closed one, without starting an engine
    other._closed, other._proc, other.capabilities = True, stock._proc, stock.capabilities
    with pytest.raises(BackendUnavailableError):
        execute(plain, other)


@pytest.mark.slow
@pytest.mark.vllm
def test_rag_bench(engines, tmp_path, capsys):
    from benchmarks.rag import MODES, SECOND_QUESTION, main

    argv = ["--model", "tiny", "--docs", "1,3", "--doc-tokens", "48", "--reps", "1", "--out", str(tmp_path),
            "--no-progress"]
    assert main(argv, backends=engines) == 0
    printed = capsys.readouterr().out
    assert "spans warm" in printed
    report = read_report(tmp_path, "rag-tiny", printed)
    assert {r["mode"] for r in report["rows"]} == set(MODES)
    assert not {r["mode"] for r in report["rows"] if r["docs"] == 1} & {"stock_subset", "spans_subset"}
    three = report["summary"]["3x48"]
    for mode in MODES:
        assert three[mode]["median"] > 0
    assert three["speedup_warm_vs_stock_reordered"] > 0
    warm = [r for r in report["rows"] if r["mode"] == "spans_warm" and r["docs"] == 3]
    assert warm[0]["prepared_spans"] == 0, "the warm run found the documents cached"
    cold = [r for r in report["rows"] if r["mode"] == "spans_cold" and r["docs"] == 3]
    assert cold[0]["prepared_spans"] + cold[0]["deferred_spans"] == 3  # prepared alone, or read in context
    profile = three["profile"]
    assert set(profile) == {"spans_cold", "spans_warm", "spans_subset"} and profile["spans_warm"]["ttft_s"] > 0
    # The baselines a careful stock user has: the same set sorted back into canonical order (another question after
    # it), and the same prompt again (the floor) — both hit the documents in stock's prefix cache, the plain
    # reordered prompt does not. Canonical computes the other question and the last document's partial block only.
    row = {r["mode"]: r for r in report["rows"] if r["docs"] == 3}
    assert row["stock_same"]["cached_tokens"] >= row["stock_same"]["prompt_tokens"] - 32
    question = len(engines[1].engine.tokenizer.encode(SECOND_QUESTION, add_special_tokens=False))
    assert row["stock_canonical"]["prompt_tokens"] - row["stock_canonical"]["cached_tokens"] <= question + 32 + 16
    assert row["stock_reordered"]["cached_tokens"] < row["stock_canonical"]["cached_tokens"]
    assert three["speedup_warm_vs_stock_canonical"] > 0 and three["speedup_warm_vs_stock_same"] > 0
    # An overlapping subset in a new order: stock's prefix cache holds no prompt starting with its first document
    # (its system prompt only); the span engine read every one of them before, and prepared none.
    assert row["stock_subset"]["cached_tokens"] < 32 <= row["stock_subset"]["prompt_tokens"] - 2 * 32
    assert row["spans_subset"]["prepared_spans"] == 0 and three["speedup_subset_vs_stock_subset"] > 0
    # each measurement right after a plain request to its own engine (the order of a pair then does not matter)
    assert report["config"]["ready"] is True and report["config"]["swap_order"] is False


@pytest.mark.slow
@pytest.mark.vllm
def test_nested_bench(engines, tmp_path):
    from benchmarks.nested import main

    argv = ["--model", "tiny", "--fan-out", "1,3", "--temperatures", "0,0.5", "--inner-tokens", "8", "--reps", "1",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv, backends=engines) == 0
    report = read_report(tmp_path, "nested-tiny")
    entry = report["summary"]["t=0.5,n=3"]
    assert entry["stock"]["n"] == entry["spans"]["n"] == 1
    assert {"speedup_p50", "speedup_p90", "speedup_p99"} <= set(entry)
    assert report["summary"]["t=0,n=3"]["distinct_candidates"] == 1, "greedy inner calls agree"


@pytest.mark.slow
@pytest.mark.vllm
def test_bulk_bench(engines, tmp_path):
    from benchmarks.bulk import main

    argv = ["--model", "tiny", "--queries", "6", "--pool", "8", "--k", "2", "--frag-tokens", "24", "--bulk", "1,0",
            "--out", str(tmp_path), "--no-progress"]
    assert main(argv, backends=engines) == 0
    report = read_report(tmp_path, "bulk-tiny")
    assert set(report["summary"]) == {"1/arrival", "6/arrival", "6/locality"}
    for entry in report["summary"].values():
        assert 0 <= entry["span_hit_rate"] <= 1 and 0 <= entry["stock_token_hit_rate"] <= 1
        assert 0 <= entry["canonical_token_hit_rate"] <= 1 and 0 <= entry["spans_token_hit_rate"] <= 1
        assert entry["speedup_mean_ttft"] > 0 and entry["speedup_vs_canonical"] > 0
    assert all(r["calls"] == 6 for r in report["rows"])
    assert {r["mode"] for r in report["rows"]} == {"stock", "stock_canonical", "spans"}
    # Every run starts cold: the span engine prepares each distinct fragment it reads at least once, in every
    # setting (a span read in an earlier setting would otherwise hit under the template anchor).
    distinct = report["config"]["unique_fragments"]
    assert all(r["prepared_spans"] >= distinct for r in report["rows"] if r["mode"] == "spans")


@pytest.mark.slow
@pytest.mark.vllm
def test_quality_bench(engines, tmp_path):
    from benchmarks.quality import main

    argv = ["--model", "tiny", "--items", "2", "--docs", "3", "--filler", "2", "--max-tokens", "4",
            "--recompute", "0,first,1", "--hf-check", "1", "--speed-docs", "2", "--speed-tokens", "64",
            "--speed-reps", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(argv, backends=engines) == 0
    report = read_report(tmp_path, "quality-tiny")
    summary = report["summary"]
    assert summary["items"] == 2 and list(summary["settings"]) == ["template/0", "template/first", "template/1"]
    for entry in summary["settings"].values():
        assert 0 <= entry["exact_match"]["spans"]["mean"] <= 1 and entry["padding_overhead"] > 0
        for comparison in ("layout", "attention", "both"):
            b = entry[comparison]["agreement"]
            assert 0 <= b["lo"] <= b["mean"] <= b["hi"] <= 1
        assert entry["hf_check"]["items"] == 1 and entry["speed"]["warm_ttft_s"] > 0
    settings = summary["settings"]
    assert settings["template/0"]["recomputed_share"] == 0 and 0 < settings["template/first"]["recomputed_share"] < 1
    # Everything recomputed is full attention on the same tokens: the attention-only comparison must say so (and
    # the tiny random model's span attention does not agree, so the measurement can tell the two apart).
    assert settings["template/1"]["attention"]["agreement"]["mean"] == 1.0
    assert settings["template/1"]["hf_check"]["hf_kl"] < 1e-6
    assert settings["template/0"]["attention"]["agreement"]["mean"] < 1.0
    # The same-order reference: stock on the plain prompt with the documents in the order the spans read them.
    # Where that is the order given it is the plain reference itself; where not, stock reads another prompt (a
    # reference left in the given order would give "same" = "both" on every item).
    rows = report["rows"]
    assert any(r["reordered"] for r in rows), "no item was reordered: the check below could not fail"
    for r in rows:
        if r["reordered"]:
            assert r["order_kl"] > 0 and r["same_kl"] != r["both_kl"], r
        else:
            assert r["order_agreement"] == 1.0 and r["same_kl"] == r["both_kl"], r
    assert 0 <= settings["template/0"]["exact_match"]["same_order"]["mean"] <= 1

    # The demo's items read one set of documents: items 0 and 2 ask the same question, and the spans read the set in
    # one order, so their prompts (stock's in the span order, and the spans') are the same tokens again. Asked again,
    # a prompt's rows would come from the prefix cache, with no distribution computed: each is scored once.
    demo = ["--model", "tiny", "--tasks", "demo", "--items", "3", "--max-tokens", "2", "--recompute", "0",
            "--hf-check", "0", "--speed-docs", "0", "--out", str(tmp_path / "demo"), "--no-progress"]
    assert main(demo, backends=engines) == 0
    rows = read_report(tmp_path / "demo", "quality-tiny")["rows"]
    assert [r["item"] for r in rows] == [0, 1, 2]
    assert rows[0]["same_kl"] == rows[2]["same_kl"] and rows[0]["spans_answer"] == rows[2]["spans_answer"]

    # Documents in the system prompt (LangChain's RAG template): stock reads them there, and so do the spans.
    from benchmarks.quality import make_task_items, qa_query
    from spanq_backend.serving.generator import flattened_prompt_ids

    item = make_task_items("system-prompt", 1, 3, seed=0)[0]
    tokenizer = engines[1].engine.tokenizer
    stock_ids = flattened_prompt_ids(tokenizer, qa_query(item, 2).input)
    for ids in (stock_ids, engines[1].engine.generator.lower(qa_query(item, 2)).token_ids):
        system_turn = tokenizer.decode(ids).split("<|im_start|>user")[0]
        assert all(doc in system_turn for doc in item.docs)
    shape = ["--model", "tiny", "--tasks", "system-prompt", "--items", "1", "--max-tokens", "2", "--recompute", "0",
             "--hf-check", "0", "--speed-docs", "0", "--out", str(tmp_path / "system"), "--no-progress"]
    assert main(shape, backends=engines) == 0
    assert [r["task"] for r in read_report(tmp_path / "system", "quality-tiny")["rows"]] == ["system-prompt"]


# --------------------------------------------------------------------------------------------- the docs' commands

_DOC_FILES = ("README.md", "docs/benchmarks.md", "docs/design.md", "docs/architecture.md")
_BENCH_COMMAND = re.compile(r"(?:\bspanq|spanq_integrations\.cli) bench ([a-z]+)((?:[^`#&|;\n])*)")


def documented_bench_commands(root: Path) -> list[tuple[str, str, list[str]]]:
    """Every `spanq bench NAME ...` the project's docs write (where, NAME, its arguments): each line of a fenced
    block (one ending in a backslash joined to the next) and each inline code span (one that wraps, joined), up to
    a shell comment, a `&&` or a pipe. A command shown in part ("... --tag X ...") is skipped."""
    import shlex

    found = []
    for name in _DOC_FILES:
        text = (root / name).read_text()
        pieces = []  # (offset, text)
        for block in re.finditer(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", text, re.MULTILINE | re.DOTALL):
            offset = block.start(1)
            for line in block.group(1).replace("\\\n", "  ").split("\n"):
                pieces.append((offset, line))
                offset += len(line) + 1
        prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.MULTILINE | re.DOTALL)
        pieces += [(m.start(1), m.group(1).replace("\n", " ")) for m in re.finditer(r"`([^`]+)`", prose)]
        for offset, piece in sorted(pieces):
            for match in _BENCH_COMMAND.finditer(piece):
                args = match.group(2).strip()
                if args.endswith(("...", "…")):
                    continue
                found.append((f"{name}:{text.count(chr(10), 0, offset) + 1}", match.group(1), shlex.split(args)))
    return found


def test_every_bench_command_the_docs_write_parses_as_written(capsys):
    """A reader who copies a documented benchmark command gets the benchmark, not a usage error: every one in the
    README and docs is parsed by its benchmark's own parser (its checks after parsing included). `--topics 0` of
    `bench cluster` (documents drawn independently, as the docs measure it) was refused as "must be at least 1"."""
    root = Path(benchmarks.__file__).resolve().parents[1]
    commands = documented_bench_commands(root)
    assert len(commands) > 100, f"found only {len(commands)} commands: the pattern no longer matches the docs"
    refused = []
    for where, name, argv in commands:
        assert name in BENCHMARKS, f"{where}: no benchmark {name!r}"
        try:
            importlib.import_module(BENCHMARKS[name][0]).parse_args(argv)
        except SystemExit as e:
            if e.code:  # (`--help` is 0)
                refused.append(f"{where}: spanq bench {name} {' '.join(argv)}")
    assert not refused, "\n".join(refused)


def test_a_documented_command_the_parser_refuses_is_named(tmp_path):
    """The check above can fail: a doc with a misspelt option is named with its line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(
        "```sh\nspanq bench rag --model tiny --grid\nspanq bench rag --gird  # x\n```\n"
        "Measured with (`spanq bench rag --model tiny --docs\n4 --reps 2`; see `spanq bench rag ...`).\n")
    for name in ("README.md", "docs/design.md", "docs/architecture.md"):
        (tmp_path / name).write_text("")
    commands = documented_bench_commands(tmp_path)
    assert [(w, n, a) for w, n, a in commands] == [
        ("docs/benchmarks.md:2", "rag", ["--model", "tiny", "--grid"]),
        ("docs/benchmarks.md:3", "rag", ["--gird"]),
        ("docs/benchmarks.md:5", "rag", ["--model", "tiny", "--docs", "4", "--reps", "2"]),
    ]
    with pytest.raises(SystemExit):
        importlib.import_module(BENCHMARKS["rag"][0]).parse_args(commands[1][2])


def test_benchmark_flags_a_run_could_not_use_are_usage_errors_before_any_engine_starts(capsys):
    """Found by a newcomer's review: `rerope --shapes foo` ended in a KeyError, `--patterns foo` measured a made-up
    pattern, `--moved 0` a table of zeros, `--moved` over half of `--num-blocks` nothing, silently; `nested
    --temperatures -1` and `rag --kv-cache-gib 0` were refused only after both engines had started. And `--help`
    cut a benchmark's description off mid-sentence (its docstring's first line)."""
    def refused(name: str, *argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            importlib.import_module(BENCHMARKS[name][0]).parse_args(list(argv))
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "--shapes: unknown shapes ['foo']; choose from tiny, tiny-4h, smollm2" in refused("rerope", "--shapes", "foo")
    assert "--patterns: unknown patterns ['foo']; choose from scattered, runs" in refused("rerope", "--patterns", "foo")
    assert "expected integers of at least 1" in refused("rerope", "--moved", "0")
    assert "every count is over half of --num-blocks 64" in refused("rerope", "--moved", "2048", "--num-blocks", "64")
    assert "expected temperatures from 0 to 2" in refused("nested", "--temperatures", "0,-1")
    assert "--kv-cache-gib: must be a finite number above 0" in refused("rag", "--kv-cache-gib", "0")
    # flags of another mode, ignored without it, let the default run start (minutes), and a run where no setting
    # fits the context ended in a TypeError after both engines had started
    assert "--doc-tokens-list only apply with --grid" in refused("rag", "--doc-tokens-list", "64")
    assert "--pool, --pin only apply with --corpus" in refused("tier", "--pool", "10", "--pin", "3")
    assert "no setting fits --max-model-len 256" in refused("rag", "--docs", "2", "--doc-tokens", "512",
                                                           "--max-model-len", "256")  # fmt: skip
    rag = importlib.import_module(BENCHMARKS["rag"][0])
    assert rag.parse_args(["--grid"]).doc_tokens_list == [64, 128, 256, 512]
    assert rag.parse_args(["--doc-tokens", "128"]).doc_tokens_list == [128]
    tier = importlib.import_module(BENCHMARKS["tier"][0]).parse_args(["--corpus", "--pin", "2"])
    assert (tier.pool, tier.pin, tier.kv_blocks) == (400, 2, 160)
    rerope = importlib.import_module(BENCHMARKS["rerope"][0]).parse_args(["--shapes", "tiny", "--moved", "16,4096"])
    assert (rerope.shapes, rerope.moved) == (["tiny"], [16, 4096])  # (4096 is skipped, said, when it runs)
    with pytest.raises(SystemExit):
        importlib.import_module(BENCHMARKS["quality"][0]).parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "measured on the engines, and what recomputing part of each span (`recompute=`) buys back" in shown


def test_bench_cluster_takes_topics_0_as_its_docs_and_help_say():
    """`--topics 0` (no topics: documents drawn independently by their own popularity; docs/benchmarks.md measures
    it) was refused as "must be at least 1" once counts of 0 became usage errors; a negative count still is one."""
    cluster = importlib.import_module(BENCHMARKS["cluster"][0])
    assert cluster.parse_args(["--topics", "0"]).topics == 0
    assert cluster.parse_args([]).topics == 8
    with pytest.raises(SystemExit):
        cluster.parse_args(["--topics", "-1"])


def test_no_progress_turns_the_model_loaders_bar_off_too(monkeypatch):
    """`--no-progress` turned the benchmark's bar off, and every engine start still drew transformers' "Loading
    weights" bar into the run's output."""
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()  # (an earlier benchmark run in this process may have turned it off)
    assert base_parser("x", "A benchmark.").parse_args([]).no_progress is False
    assert hf_logging.is_progress_bar_enabled(), "without the flag the loader's bar stays as it was"
    try:
        assert base_parser("x", "A benchmark.").parse_args(["--no-progress"]).no_progress is True
        assert not hf_logging.is_progress_bar_enabled()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1", "processes started later: their loaders' too"
    finally:
        hf_logging.enable_progress_bar()
