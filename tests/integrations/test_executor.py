"""The executor: closure of the tree and per-call metrics on a real server; ordering, bounds and cancellation.

Everything about the model runs on the stock vLLM server. The executor's scheduling (concurrency bound, order of
`cross` children, cancellation) is checked with a scripted backend defined here, which tests the executor only.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from spanq_integrations import (
    Assistant,
    Backend,
    BackendCapabilities,
    BackendError,
    CallMetrics,
    Completion,
    Generate,
    GenerationError,
    Plus,
    Repeat,
    aexecute,
    cross,
    execute,
    generate,
    plus,
    system,
    user,
)
from spanq_integrations.backends.openai import OpenAIBackend
from spanq_integrations.query.flatten import block_text
from spanq_integrations.query.ir import walk
from tests.conftest import STOCK_API_KEY


class ScriptedBackend(Backend):
    """Answers each call by the text of its input: "fail…" raises, "slow…" sleeps long, anything else briefly."""

    def __init__(self, max_concurrency: int = 8, failure: Exception | None = None):
        self.capabilities = BackendCapabilities(name="scripted", max_concurrency=max_concurrency)
        self.failure = failure or BackendError("scripted failure")
        self.events: list[tuple[str, str]] = []
        self.inputs: list[Generate] = []
        self.streamed_paths: list[str] = []
        self.cancelled: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, call, *, path="$", on_token=None):
        text = block_text(call.input)
        self.inputs.append(call)
        self.events.append(("start", path))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if text.startswith("fail"):
                await asyncio.sleep(0.05)
                raise self.failure
            await asyncio.sleep(30 if text.startswith("slow") else 0.02)
            if on_token is not None:
                self.streamed_paths.append(path)
                maybe = on_token(f"out({text})")
                if inspect.isawaitable(maybe):  # (a callback may be a coroutine function: `TokenCallback`)
                    await maybe
        except asyncio.CancelledError:
            self.cancelled.append(path)
            raise
        finally:
            self.in_flight -= 1
        self.events.append(("end", path))
        texts = [f"out({text})", *[f"out({text})#{k}" for k in range(1, call.n)]]  # a call of n choices: n texts
        reasons = ["stop"] * (call.n - 1) + ["length"]
        return Completion(texts=texts, finish_reasons=reasons,
                          metrics=CallMetrics(path=path, model="scripted", choices=texts, finish_reasons=reasons))


def other_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]


# --------------------------------------------------------------------------------------------- scheduling


@pytest.mark.parametrize("bound, expected", [(2, 2), (8, 6)])
async def test_plus_siblings_run_concurrently_within_the_bound(bound, expected):
    backend = ScriptedBackend(max_concurrency=bound)
    query = plus(*[generate(user(f"q{i}")) for i in range(6)])
    result = await aexecute(query, backend, optimize=False)
    assert backend.max_in_flight == expected
    assert sorted(c.path for c in result.calls) == [f"$.plus[{i}]" for i in range(6)]


async def test_max_concurrency_argument_overrides_the_backend():
    backend = ScriptedBackend(max_concurrency=8)
    await aexecute(
        plus(*[generate(user(f"q{i}")) for i in range(5)]), backend, optimize=False, max_concurrency=1
    )
    assert backend.max_in_flight == 1


async def test_cross_children_run_in_order():
    backend = ScriptedBackend()
    await aexecute(
        cross(generate(user("a")), generate(user("b")), generate(user("c"))), backend, optimize=False
    )
    paths = [f"$.cross[{i}]" for i in range(3)]
    assert backend.events == [(kind, p) for p in paths for kind in ("start", "end")]


async def test_outer_generate_reads_the_closed_inner_outputs():
    backend = ScriptedBackend()
    query = generate(cross(system("judge"), plus(generate(user("x")), generate(user("y")))))
    result = await aexecute(query, backend, optimize=False)
    outer = backend.inputs[-1]
    assert [e for e in backend.events if e[1] == "$"] == [("start", "$"), ("end", "$")]
    assert backend.events.index(("start", "$")) > max(
        backend.events.index(("end", p)) for p in ("$.g.input.cross[1].plus[0]", "$.g.input.cross[1].plus[1]")
    )
    assert not any(isinstance(n, Generate) for _, n in walk(outer.input))
    assert block_text(outer.input) == "judge\n\nout(x)\n\nout(y)"
    assert result.tree == Assistant(text="out(judge\n\nout(x)\n\nout(y))", source=outer)


async def test_on_token_streams_only_the_answer():
    backend = ScriptedBackend()
    pieces: list[str] = []
    query = generate(cross(plus(generate(user("x")), generate(user("y"))), user("pick")))
    result = await aexecute(query, backend, optimize=False, on_token=pieces.append)
    assert backend.streamed_paths == ["$"]
    assert "".join(pieces) == result.answer


@pytest.mark.parametrize(
    "failure, error_type",
    [(BackendError("server said no"), BackendError), (RuntimeError("bug"), GenerationError)],
)
async def test_a_failing_call_names_its_path_and_cancels_running_siblings(failure, error_type):
    backend = ScriptedBackend(failure=failure)
    query = generate(
        cross(
            system("judge"), plus(generate(user("slow 1")), generate(user("fail")), generate(user("slow 2")))
        )
    )
    with pytest.raises(error_type) as info:
        await aexecute(query, backend, optimize=False)
    assert "$.g.input.cross[1].plus[1]" in str(info.value)
    assert sorted(backend.cancelled) == ["$.g.input.cross[1].plus[0]", "$.g.input.cross[1].plus[2]"]
    assert ("start", "$") not in backend.events  # the judge never ran
    assert other_tasks() == []


async def test_sync_execute_works_inside_a_running_event_loop():
    backend = ScriptedBackend()
    result = execute(plus(generate(user("a")), generate(user("b"))), backend, optimize=False)
    assert isinstance(result.tree, Plus) and [c.text for c in result.tree.children] == ["out(a)", "out(b)"]


# --------------------------------------------------------------------------------------------- the real server


def judge_query(max_tokens: int = 8) -> Generate:
    candidates = [
        generate(
            cross(system("Write one line."), user(f"Describe a {thing}.")),
            max_tokens=max_tokens,
            temperature=0,
        )
        for thing in ("river", "mountain", "city")
    ]
    return generate(
        cross(system("You judge answers."), plus(*candidates), user("Which description is best?")),
        max_tokens=max_tokens,
        temperature=0,
    )


@pytest.mark.vllm
async def test_judge_over_three_generations_closes_the_tree(stock_vllm_server):
    async with OpenAIBackend(stock_vllm_server, model="tiny", api_key=STOCK_API_KEY) as backend:
        result = await aexecute(judge_query(), backend, optimize=False)
    tree = result.tree
    assert isinstance(tree, Assistant) and tree.text and tree.source is not None
    candidates = [n for _, n in walk(tree.source.input) if isinstance(n, Assistant)]
    assert len(candidates) == 3  # the judge's input holds the three generated candidates
    for node in (tree, *candidates):
        assert isinstance(node.source, Generate)
        assert not any(isinstance(n, Generate) for _, n in walk(node.source.input))  # closed inputs
    inner_paths = [f"$.g.input.cross[1].plus[{i}]" for i in range(3)]
    assert sorted(c.path for c in result.calls) == ["$", *inner_paths]
    assert result.calls[-1].path == "$"  # the judge finishes last
    judge_call = result.calls[-1]
    assert judge_call.prompt_tokens > max(c.prompt_tokens for c in result.calls[:-1])
    assert all(c.ttft_s is not None and 0 < c.ttft_s <= c.wall_s for c in result.calls)
    assert result.answer == tree.text
    assert result.totals()["calls"] == 4


@pytest.mark.vllm
def test_sync_execute_on_a_server_url(stock_vllm_server):
    result = execute(judge_query(max_tokens=4), f"{stock_vllm_server}/v1", optimize=False)
    assert result.answer and len(result.calls) == 4
    assert {c.model for c in result.calls} == {"tiny"}


class SpanOutputBackend(ScriptedBackend):
    """Records, per call path, whether the executor said its output would be read as a span."""

    def __init__(self, span_outputs: bool):
        super().__init__()
        self.capabilities = BackendCapabilities(name="spans", span_aware=True, span_outputs=span_outputs)
        self.span_output: dict[str, bool] = {}

    async def generate(self, call, *, path="$", on_token=None, **kwargs):
        self.span_output[path] = kwargs.get("span_output", False)
        return await super().generate(call, path=path, on_token=on_token)


def test_only_generates_an_outer_generate_reads_through_a_plus_are_told_their_output_is_a_span():
    judge = generate(cross(user("pick"), plus(generate(user("a")), generate(user("b"))), user("which?")))
    batch = plus(generate(user("c")), judge, Repeat(n=2, query=generate(user("d"))))
    backend = SpanOutputBackend(span_outputs=True)
    execute(batch, backend)
    told = {p for p, flag in backend.span_output.items() if flag}
    assert told == {"$.plus[1].g.input.cross[1].plus[0]", "$.plus[1].g.input.cross[1].plus[1]"}, backend.span_output
    assert not backend.span_output["$.plus[1]"] and not backend.span_output["$.plus[0]"], "top-level calls are not"


def test_a_backend_without_span_outputs_is_never_passed_the_flag():
    judge = generate(cross(user("pick"), plus(generate(user("a")), generate(user("b"))), user("which?")))
    backend = SpanOutputBackend(span_outputs=False)
    execute(judge, backend)
    assert backend.span_output and not any(backend.span_output.values())


# ------------------------------------------------------------------------------------ combine in code


def test_a_combine_runs_its_generates_and_combines_their_answers_in_code():
    from spanq_integrations.query import spnl_json
    from spanq_integrations.query.ir import Combine, combine

    backend = ScriptedBackend()
    leaves = plus(generate(user("Ada, Bo")), generate(user("Bo; Cy")), generate(user("NONE")))
    query = combine(leaves, "extract", item_pattern="[A-Z][a-z]+")
    query = spnl_json.loads(spnl_json.dumps(query))  # a combine travels in the JSON form too
    pieces: list[str] = []
    result = execute(query, backend, on_token=pieces.append)
    assert len(backend.inputs) == 3  # the generates, no call for the combine
    # the answers out(Ada, Bo), out(Bo; Cy), out(NONE) read with the item pattern: the union, in order
    assert result.answer == "Ada\nBo\nCy"
    assert isinstance(result.tree, Assistant) and isinstance(result.tree.source, Combine)
    assert sorted(c.path for c in result.calls) == [f"$.combine.input.plus[{i}]" for i in range(3)]
    assert "".join(pieces) == result.answer  # the combined answer is what streams


def test_an_answer_a_combine_cannot_read_is_named_in_the_result():
    """A leaf whose answer does not follow the reducer's format adds nothing to the combined answer; the result
    says which one and why (not only `judge()`, which reads its own provenance)."""
    from spanq_integrations.query.ir import combine

    leaves = plus(generate(user("1")), generate(user("two")), generate(user("1")))  # each judge read one text
    result = execute(combine(leaves, "count"), ScriptedBackend())
    assert result.answer == "2"  # 1 + 1: the unreadable answer counts for nothing
    assert [u.path for u in result.unread] == ["$.combine.input.plus[1]"]
    assert "no count" in result.unread[0].error and "out(two)" in result.unread[0].error

    readable = execute(combine(plus(generate(user("1")), generate(user("0"))), "count"), ScriptedBackend())
    assert readable.answer == "1" and readable.unread == []


@pytest.mark.parametrize(
    "reducer, options, message",
    [
        ("poll", {}, "unknown reducer 'poll'"),
        ("merge", {}, "the merge reducer needs a model to combine answers"),
        ("extract", {"colour": "red"}, "not options of the extract reducer"),
    ],
)
def test_a_combine_the_executor_cannot_run_is_refused_before_any_call(reducer, options, message):
    from spanq_integrations import QueryValidationError
    from spanq_integrations.query.ir import Combine

    backend = ScriptedBackend()
    query = Combine(input=plus(generate(user("a")), generate(user("b"))), reducer=reducer, options=options)
    with pytest.raises(QueryValidationError, match=message) as caught:
        execute(query, backend)
    assert caught.value.path.startswith("$.combine")
    assert backend.inputs == []


async def test_an_empty_map_runs_no_call_and_is_no_error():
    """`{"map": {"inputs": []}}` is a valid query (its round trip is lossless); it ran into `asyncio.wait([])` and
    a server answered 500."""
    from spanq_integrations.query.spnl_json import from_json

    backend = ScriptedBackend()
    result = await aexecute(from_json({"map": {"inputs": []}}), backend, optimize=False)
    assert backend.events == [] and result.calls == []


# --------------------------------------------------------------------------------------------- nothing to run


def test_a_query_with_no_model_call_or_a_plain_string_is_refused_before_a_backend_starts():
    """A newcomer's first mistakes: messages with no generate around them ran 0 calls and answered "" (after the
    embedded engine's start, seconds), and a plain string failed inside the executor with an AttributeError."""
    from spanq_integrations import QueryValidationError

    backend = ScriptedBackend()
    with pytest.raises(QueryValidationError, match=r"makes no model call .* wrap its messages in generate"):
        execute(cross(system("Answer briefly."), user("What?")), backend)
    with pytest.raises(TypeError, match=r"execute takes a span query .* not str .*execute\(generate\(user"):
        execute("What color is it?", backend)
    assert backend.inputs == []
    # a generate anywhere in it runs, as before
    assert execute(cross(system("s"), generate(user("hi"))), backend).calls


def test_a_call_with_nothing_to_send_is_refused_at_its_input_before_anything_runs(capsys):
    """It failed at the backend, after the prints and calls before it had run, at the path of its call (`$` for the
    one call of a query; a plan's `$.plus[0]` for a map's input, a node the query never had)."""
    from spanq_integrations import QueryValidationError
    from spanq_integrations.query.ir import Print
    from spanq_integrations.query.spnl_json import from_json

    backend = ScriptedBackend()
    for query, path in [
        (cross(Print(text="printed first"), generate(user("a")), generate(cross(system(""), Print(text="p")))),
         "$.cross[2].g.input"),
        (from_json({"map": {"metadata": {"model": "", "max_tokens": 3}, "inputs": ["a", ""]}}), "$.map.inputs[1]"),
        (from_json({"g": {"model": "", "input": {"user": ""}, "max_tokens": 4}}), "$.g.input"),
    ]:
        with pytest.raises(QueryValidationError, match="nothing to send to the model") as raised:
            execute(query, backend)
        assert raised.value.path == path
    assert backend.inputs == [] and "printed first" not in capsys.readouterr().out
    # an input that holds only another call's answer says something
    assert execute(generate(plus(generate(user("a")))), backend).answer == "out(out(a))"


@pytest.mark.vllm
def test_a_repeat_built_in_python_runs_each_copy_and_answers_each():
    """`repeat(generate(...), n)`, the builder of spnl's repeat (only the class existed: `Repeat(n=2, query="x")` was
    a pydantic error), gives n answers."""
    from spanq_integrations import repeat

    result = execute(repeat(generate(user("a")), 3), ScriptedBackend())
    assert len(result.calls) == 3 and len(result.answers) == 3 and result.answers[-1] == result.answer


def test_a_bulk_query_whose_calls_have_several_choices_answers_every_choice():
    """`repeat(generate(..., n=2), 3)` ran 6 choices and `answers` listed one: a bulk query counted only calls of
    one choice (and `spanq serve`'s spnl answer, read the same way, gave one choice)."""
    from spanq_backend.serving.spnl_wire import choices_of
    from spanq_integrations import repeat

    result = execute(repeat(generate(user("a"), n=2), 3), ScriptedBackend())
    assert len(result.calls) == 3
    assert result.answers == ["out(a)", "out(a)#1"] * 3 and result.answers[-1] == result.answer
    assert choices_of(result) == [("out(a)", "stop"), ("out(a)#1", "length")] * 3
    mixed = execute(plus(generate(user("a"), n=2), generate(user("b"))), ScriptedBackend(), optimize=False)
    assert mixed.answers == ["out(a)", "out(a)#1", "out(b)"]
    assert execute(repeat(generate(user("a")), 2), ScriptedBackend()).answers == ["out(a)"] * 2  # one choice each


def test_on_answer_token_streams_every_answer_of_a_bulk_query_by_its_index():
    """Each call of a bulk query streams its first choice under that choice's index in `answers` (what `spanq
    serve` streams a `repeat` or a `map` by); a query of one answer streams it as index 0."""
    streamed: list[tuple[int, str]] = []
    result = execute(plus(generate(user("a"), n=2), generate(user("b"))), ScriptedBackend(), optimize=False,
                     on_answer_token=lambda k, piece: streamed.append((k, piece)))
    assert sorted(streamed) == [(0, "out(a)"), (2, "out(b)")] and result.answers[2] == "out(b)"
    streamed.clear()
    execute(cross(system("s"), generate(user("c"))), ScriptedBackend(), on_answer_token=lambda *kp: streamed.append(kp))
    assert streamed == [(0, "out(c)")]


@pytest.mark.parametrize("wrong", [0, -1, 2.5, True])
def test_a_concurrency_that_is_not_a_count_of_calls_is_refused(wrong):
    """0 ran at the backend's limit and -1 at 1, silently."""
    from spanq_integrations import QueryValidationError

    with pytest.raises(QueryValidationError, match=r"execute\(max_concurrency\): calls in flight at once"):
        execute(generate(user("hi")), ScriptedBackend(), max_concurrency=wrong)


def test_calls_that_name_no_model_follow_the_one_the_others_name():
    """Inner calls with no model name ("") beside an outer `model="tiny"` run where the query runs: the query's
    model is "tiny" (it was none, so the default model's engine was started, warning that it does not serve tiny)."""
    from spanq_integrations.query.ir import plus
    from spanq_integrations.runtime.executor import _one_model

    nested = generate(cross(plus(generate("a"), generate("b")), "q"), model="tiny")
    assert _one_model(nested) == "tiny"
    assert _one_model(generate(cross(plus(generate("a", model="other")), "q"), model="tiny")) is None
    assert _one_model(generate("q")) is None


def test_execute_and_judge_with_no_backend_run_on_the_model_their_calls_name(tiny_model, monkeypatch):
    """`execute` of calls that all name "tiny", and `judge(..., model="tiny")`, with no backend, run on the
    embedded tiny engine, as `ChatSpanQuery(model="tiny")` does: they started the default model's engine and ran
    there, warning that it does not serve "tiny". A name the embedded engine cannot start (here "gpt-17") still
    runs on the default engine: `embedded_model_named` says so without starting anything."""
    from spanq_backend.serving.embedded import shared_embedded_backend
    from spanq_integrations import judge
    from spanq_integrations.backends.resolve import embedded_model_named

    monkeypatch.delenv("SPANQ_BACKEND", raising=False)
    try:
        result = execute(generate(user("Say hi."), model="tiny", max_tokens=2, temperature=0))
        assert [c.model for c in result.calls] == [tiny_model.name]
        verdict = judge(["a cat", "a dog", "a cow"], "Which is largest?", k=2, model="tiny", max_tokens=4)
        assert verdict.calls and {c.model for c in verdict.calls} == {tiny_model.name}
        assert shared_embedded_backend("tiny").engine.model_path == tiny_model
    finally:
        shared_embedded_backend("tiny").shutdown()
    assert embedded_model_named(None, "gpt-17") is None and embedded_model_named(None, "Qwen/Qwen3-8B") is None
    assert embedded_model_named("http://127.0.0.1:9/v1", "tiny") is None  # a URL backend: its own model names
    assert embedded_model_named(None, "tiny") == "tiny"
    assert embedded_model_named(None, "spnl/tiny") == "tiny"  # a provider of spnl's is no part of the name
