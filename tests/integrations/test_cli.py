"""The `spanq` command line: plan, run, and the one-line errors on bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from spanq_integrations.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]

# A judge over three retrieved documents, written the way spnl writes queries.
SPNL_QUERY = {
    "g": {
        "model": "spnl/tiny",
        "max_tokens": 6,
        "temperature": 0,
        "input": {
            "seq": [
                {"system": "Answer from the documents."},
                {
                    "par": [
                        {"user": "The hall in Ashby is red."},
                        {"user": "The hall in Brill is blue."},
                        {"user": "The hall in Calne is green."},
                    ]
                },
                {"user": "What colour is the hall in Brill?"},
            ]
        },
    }
}


@pytest.fixture
def query_file(tmp_path) -> Path:
    path = tmp_path / "judge.json"
    path.write_text(json.dumps(SPNL_QUERY))
    return path


def spanq_command() -> list[str]:
    """The installed console script when there is one, else the module."""
    script = Path(sys.executable).parent / "spanq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "spanq_integrations.cli"]


# --------------------------------------------------------------------------------------------- plan


def test_plan_prints_the_tree(query_file, capsys):
    assert main(["plan", str(query_file), "--no-span-aware"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("generate(model=spnl/tiny")
    assert "par (order-free, 3)" in out and "What colour is the hall in Brill?" in out


def test_plan_json_reads_back(query_file, capsys):
    from spanq_integrations.query.spnl_json import from_json

    assert main(["plan", str(query_file), "--json"]) == 0
    plan = from_json(json.loads(capsys.readouterr().out))
    assert plan.model == "spnl/tiny"


def test_plan_shows_a_tree_combined_in_code(query_file, capsys):
    assert main(["plan", str(query_file), "--no-span-aware", "--tree-k", "2", "--reducer", "extract"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("combine in code (reducer=extract)")
    assert out.count("generate(model=spnl/tiny") == 2  # (Ashby, Brill) and (Calne): leaves only


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reducer", "extract"], "--reducer needs --tree-k"),
        (["--tree-k", "2", "--reducer", "merge"], "merge reducer needs a model"),
        (["--tree-k", "2", "--reducer", "poll"], "spanq: error: --reducer: unknown reducer 'poll'"),
        (["--tree-k", "0"], "got 0; leave it out for no tree reduction"),  # (not Python's "pass None")
        # its leaves must rate every candidate, which a query file does not ask: every leaf's answer was refused
        (["--tree-k", "2", "--reducer", "select"], "--reducer select: its leaves must be asked otherwise"),
    ],
)
def test_plan_refuses_a_combine_it_cannot_plan(query_file, capsys, argv, message):
    assert main(["plan", str(query_file), *argv]) != 0
    assert message in capsys.readouterr().err


def test_plan_reads_stdin(query_file, capsys, monkeypatch):
    with open(query_file) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        assert main(["plan", "-", "--no-span-aware"]) == 0
    assert "generate(" in capsys.readouterr().out


def test_plan_as_a_subprocess(query_file):
    done = subprocess.run(
        [*spanq_command(), "plan", str(query_file), "--no-span-aware"],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "par (order-free, 3)" in done.stdout


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "cannot read"),
        ("{not json", "spanq: error:"),
        ('{"g": {"input": {"usr": "typo"}}}', "$.g.input"),
        ("[]", "spanq: error:"),
    ],
    ids=["missing-file", "malformed-json", "unknown-node", "not-an-object"],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, content, expected):
    path = tmp_path / "query.json"
    if content is not None:
        path.write_text(content)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spanq: error:") and expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"plus": [{"bogus": 1}]}')
    done = subprocess.run(
        [*spanq_command(), "plan", str(path)],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("spanq: error:") and "Traceback" not in done.stderr


def test_backend_down_is_exit_2(query_file, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["run", str(query_file), "--backend", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spanq: error:") and "cannot reach" in err and "Traceback" not in err


def test_usage_error_is_exit_2(capsys):
    assert main(["plan"]) == 2
    assert main(["frobnicate"]) == 2


# --------------------------------------------------------------------------------------------- serve and bench


def test_serve_delegates_to_the_backend_package(monkeypatch):
    seen: list[list[str]] = []
    fake = types.ModuleType("spanq_backend.serving.server")
    fake.serve_main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "spanq_backend.serving.server", fake)
    assert main(["serve", "--port", "8000", "--model", "tiny"]) == 0
    assert seen == [["--port", "8000", "--model", "tiny"]]


def test_bench_without_the_backend_extra_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "benchmarks", None)  # makes the import fail
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "spanq bench needs the backend extra: pip install 'spanq[backend]'" in err


# --------------------------------------------------------------------------------------------- run


@pytest.mark.vllm
def test_run_prints_the_answer_and_a_metrics_table(query_file, stock_vllm_server, capsys):
    assert main(["run", str(query_file), "--backend", stock_vllm_server, "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    answer, _, table = out.partition("\n\n")
    assert answer.strip()
    header, _, *rows = table.strip().splitlines()
    assert header.split() == [
        "path",
        "model",
        "TTFT",
        "ms",
        "prompt",
        "cached",
        "generated",
        "padded",
        "wall",
        "ms",
    ]
    assert rows[0].startswith("$ ") and " tiny " in rows[0]
    assert rows[-1].startswith("total (1 calls)")


@pytest.mark.vllm
def test_run_says_a_fallback_and_a_combine_that_read_nothing(query_file, stock_vllm_server, capsys):
    """On a plain server the spans go as plain text: said on stderr (only --json showed `fallback`). A tree whose
    combine in code reads none of its leaves (the tiny model does not count) is no answer: exit 1 with why, as
    `judge` says "no verdict" (it printed an empty answer and exited 0)."""
    argv = ["run", str(query_file), "--backend", stock_vllm_server, "--model", "tiny"]
    assert main(argv) == 0
    assert "spanq run: $: an OpenAI-compatible server: the spans were sent as plain text" in capsys.readouterr().err
    argv += ["--tree-k", "2", "--reducer", "count"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "spanq run: error: no answer: the combine could read none of the answers below it (the first: $" in err
    assert main([*argv, "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["answer"] == "" and "error: no answer" in captured.err


@pytest.mark.vllm
def test_run_json(query_file, stock_vllm_server, capsys):
    assert (
        main(["run", str(query_file), "--backend", f"{stock_vllm_server}/v1", "--json", "--model", "tiny"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["answer"] and report["totals"]["calls"] == 1
    assert report["calls"][0]["prompt_tokens"] > 0 and report["calls"][0]["model"] == "tiny"
    assert "assistant" in report["result"]


@pytest.mark.vllm
def test_run_prints_every_answer_of_a_bulk_query_and_each_choice_once(tmp_path, stock_vllm_server, capsys):
    """A map's answers, each under its header (only the last was printed: the first input's answer was nowhere in
    the output); a call of n choices streams choice 0 under its header and prints it once (it was printed twice:
    streamed, then again under "--- choice 0 ---")."""
    from spanq_integrations.query.ir import Map, generate
    from spanq_integrations.query.spnl_json import to_json

    bulk = tmp_path / "map.json"
    bulk.write_text(json.dumps(to_json(Map(inputs=("Say apple.", "Say pear."), max_tokens=4, temperature=0))))
    argv = ["run", str(bulk), "--backend", stock_vllm_server, "--model", "tiny"]
    assert main([*argv, "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)["answers"]
    assert len(answers) == 2 and all(answers)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"--- answer 0 ---\n{answers[0]}\n--- answer 1 ---\n{answers[1]}\n"), out

    choices = tmp_path / "choices.json"
    choices.write_text(json.dumps(to_json(generate("Say a fruit.", n=2, max_tokens=4, temperature=1.0, seed=3))))
    assert main(["run", str(choices), "--backend", stock_vllm_server, "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- choice 0 ---\n") and out.count("--- choice 0 ---") == 1, out
    assert out.count("--- choice 1 ---") == 1, out


@pytest.mark.vllm
def test_run_as_a_subprocess(query_file, stock_vllm_server):
    done = subprocess.run(
        [*spanq_command(), "run", str(query_file), "--backend", stock_vllm_server, "--model", "vllm/tiny"],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
        env={**os.environ, "SPANQ_DEBUG": ""},
    )
    assert done.returncode == 0, done.stderr
    assert "TTFT ms" in done.stdout and "total (1 calls)" in done.stdout


# --------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize(("model", "named"), [
    ("Qwen/Qwen3-0.6B", "not in the local Hugging Face cache"),
    ("no such model", "unknown model"),
])
def test_run_on_a_model_that_is_not_there_is_one_line_and_exit_2(query_file, capsys, monkeypatch, model, named):
    pytest.importorskip("vllm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", str(query_file), "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spanq: error:") and named in err and repr(model) in err and "Traceback" not in err


@pytest.mark.parametrize(("model", "named"), [
    ("tiny-olmo2", "Transformers backend"),
    ("Qwen/Qwen3-0.6B", "HF_HUB_OFFLINE"),
])
def test_serve_refuses_before_vllm_starts(monkeypatch, capsys, model, named):
    """A model spans are refused on, or one not on this machine: one line, exit 2, nothing started."""
    pytest.importorskip("vllm")
    from spanq_backend.serving.server import serve_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert serve_main(["--model", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spanq serve: error:") and named in err and "Traceback" not in err


def test_serve_refuses_a_bad_recompute_setting_before_vllm_starts(capsys):
    pytest.importorskip("vllm")
    from spanq_backend.serving.server import serve_main

    with pytest.raises(SystemExit) as exit_:
        serve_main(["--model", "tiny", "--recompute", "most"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--recompute" in err and "recompute must be" in err and "Traceback" not in err


def test_serve_help_shows_every_flag_of_the_command(capsys):
    """The cluster's flags (they take effect with --replicas) are in `spanq serve --help` too."""
    pytest.importorskip("vllm")
    from spanq_backend.serving.server import serve_main

    with pytest.raises(SystemExit) as exit_:
        serve_main(["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    for flag in ("--replicas", "--routing", "--ray-address", "--max-imbalance", "--tier-cost", "--recompute", "--span-anchor",
                 "--max-body-bytes", "--model", "--cold-spans", "--no-read-in-context"):
        assert flag in shown, flag
    # vLLM's --help lists its groups only: spanq's own options and limits have groups of their own, named there,
    # whose help describes each flag (they were in vLLM's unnamed group, described under --help=all alone)
    assert "--help=spanq" in shown and "--help=limits" in shown and "--help=cluster" in shown
    # the list of groups keeps its layout: a long group title pushed every description into a narrow column
    assert re.search(r"^  CacheConfig\s+Configuration for the KV cache\.$", shown, re.MULTILINE), shown[-3000:]

    def group_help(name: str) -> str:
        with pytest.raises(SystemExit):
            serve_main([f"--help={name}"])
        return capsys.readouterr().out

    own = group_help("spanq")
    for flag in ("--span-anchor", "--span-lead-in", "--cold-spans", "--recompute", "--tier-dir", "--verbose"):
        assert re.search(rf"^  {flag}\b.*\n\s+\S", own, re.MULTILINE), (flag, own)
    # no default that misleads: "(default: True)" on a --no- flag, "(default: None)" after "no limit"
    assert "(default: True)" not in own and "(default: None)" not in own, own
    assert "--replicas" in group_help("cluster")
    limits = group_help("limits")
    assert re.search(r"--max-n N\s+the most choices of one generate call \(n\) \(default: 16\)", limits), limits
    assert "(default 16)" not in limits  # said once


def test_serve_refuses_a_cluster_flag_without_replicas(capsys):
    pytest.importorskip("vllm")
    from spanq_backend.serving.server import serve_main

    assert serve_main(["--model", "tiny", "--routing", "default"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spanq serve: error: --routing needs --replicas") and "Traceback" not in err


@pytest.mark.vllm
def test_an_embedded_run_ends_cleanly_and_prints_every_choice(tmp_path):
    """`spanq run` on the embedded engine: its new documents are prepared as spans while the answer is printed,
    and the process ends meanwhile — which printed the engine's failure and a traceback on every run. A call of
    n choices prints each (choice 0 as it streams)."""
    doc = json.loads(json.dumps(SPNL_QUERY))
    doc["g"].update(model="", n=2, temperature=1.0)
    path = tmp_path / "two.json"
    path.write_text(json.dumps(doc))
    done = subprocess.run([*spanq_command(), "run", str(path), "--model", "tiny"], check=False, capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=300, env={**os.environ, "SPANQ_DEBUG": ""})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "engine failed" not in done.stderr, done.stderr[-2000:]
    assert "--- choice 0 ---" in done.stdout and "--- choice 1 ---" in done.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--bulk", "q.jsonl", "--tree-k", "2"], "--bulk does not take --tree-k"),
    (["run", "q.json", "--actors", "3"], "--actors run a --bulk file"),
])
def test_flags_that_would_do_nothing_are_refused(argv, message, capsys):
    from spanq_integrations.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--tier-dir", "t", "--tier-max-gb", "inf"], "(--tier-max-gb) must be a finite number of GB above 0, got inf"),
    (["--tier-dir", "t", "--tier-max-gb", "-1"], "(--tier-max-gb) must be a finite number of GB above 0, got -1"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching turns span reuse off"),
    (["--port", "99999"], "--port must be a port number, 0-65535; got 99999"),  # was the socket's, once loaded
])
def test_serve_refuses_values_that_cannot_work_in_one_line(flags, message, capsys, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from spanq_backend.serving.server import serve_main

    monkeypatch.chdir(tmp_path)
    try:
        code = serve_main(["--model", "tiny", *flags])
    except SystemExit as e:  # an option's own error: argparse's usage line and the error, exit status 2
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.vllm
def test_an_embedded_run_ends_the_answers_line_before_spanqs_progress(tmp_path):
    """The answer streams to stdout and the engine's progress ("read 3 new documents in context…") goes to stderr
    when the call ends, before the answer's line was: in a terminal it landed on it ("…Widgetspanq: read 3…")."""
    doc = json.loads(json.dumps(SPNL_QUERY))
    doc["g"].update(model="", temperature=0.0)
    path = tmp_path / "one.json"
    path.write_text(json.dumps(doc))
    done = subprocess.run([*spanq_command(), "run", str(path), "--model", "tiny"], check=False, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    assert "spanq: read" in done.stdout  # the progress line this is about
    assert not [line for line in done.stdout.splitlines() if "spanq:" in line and not line.startswith("spanq:")], done.stdout


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """`spanq plan --json | head -c 5`: the reader goes after a few bytes; spanq stops there, status 0, nothing on
    stderr. It printed "spanq: error: BrokenPipeError ..." and exited 1."""
    doc = {"g": {"model": "", "input": {"plus": [{"user": f"line {i} " * 50} for i in range(300)]}, "max_tokens": 2}}
    path = tmp_path / "big.json"
    path.write_text(json.dumps(doc))
    proc = subprocess.Popen([*spanq_command(), "plan", str(path), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO_ROOT, env={**os.environ, "SPANQ_DEBUG": ""})  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(5)
    proc.stdout.close()  # the reader goes: spanq's next writes find no one
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and err == "", err


def test_spanq_version(capsys):
    from importlib.metadata import version

    import spanq_integrations

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"spanq {version('spanq')}\n" == f"spanq {spanq_integrations.__version__}\n"
