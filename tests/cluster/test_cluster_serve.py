"""`spanq serve --replicas 2` on the tiny model: two span engines on a local Ray Serve, routed by span affinity.

One cluster for the module (about 60 s to start on this machine); `SpanBackend` is its client, unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from spanq_integrations import cross, execute, fragment, generate, plus, system, user
from spanq_integrations.backends.span import SpanBackend
from spanq_integrations.query.spnl_json import to_json
from tests.servers import cmdline, free_port, log_tail, running_server

pytest.importorskip("ray.serve", reason="the cluster extra: pip install 'spanq[cluster]'")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXECUTE = "/v1/query/execute"
KEY = "spanq-cluster-test-key"  # the cluster runs with --api-key: every request below goes with it
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = ["key", "door", "lamp", "road", "tree", "bell", "cup"]
DOCS = [f"Document {i}. " + " ".join(f"The {w} of {i} is {j}." for j, w in enumerate(WORDS * 3)) for i in range(6)]
GROUPS = [DOCS[:3], DOCS[3:]]


def rag(docs: list[str], max_tokens: int = 4):
    return generate(
        cross(system("Answer from the documents."), plus(*[fragment(d) for d in docs]), user("Which door?")),
        max_tokens=max_tokens,
        temperature=0.0,
    )


def workload(n: int, seed: int = 3) -> list[list[str]]:
    """Queries over two pools of three documents each, in random orders."""
    rng = random.Random(seed)
    return [rng.sample(GROUPS[i % 2], 3) for i in range(n)]


class Cluster:
    def __init__(self, url: str, pid: int, log: Path):
        self.url, self.pid, self.log = url, pid, log

    def replica_servers(self) -> list[int]:
        """The pids of the replicas' own `spanq serve` processes (descendants of the cluster's process)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                todo.append(child)
                try:
                    command = (Path("/proc") / str(child) / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"spanq_integrations.cli" in command and b"--replicas" not in command and not any(
                    b"supervise" in part for part in command
                ):
                    found.append(child)
        return found

    def replica_urls(self) -> dict[int, str]:
        """Each replica server's pid and its own URL (from the `--port` its replica gave it)."""
        urls = {}
        for pid in self.replica_servers():
            command = cmdline(pid).decode().split("\0")
            if "--port" in command[:-1]:  # (empty: the process is gone)
                urls[pid] = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        return urls

    def wait_for_replicas(self, n: int = 2, timeout_s: float = 300) -> None:
        """Until `n` replicas' servers answer `/health` themselves (a restarted replica's process exists ~45 s
        before its engine is up and Ray routes to it), then a moment for Ray to tell the ingress's router."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = 0
            for url in self.replica_urls().values():
                with contextlib.suppress(httpx.HTTPError):
                    ready += httpx.get(f"{url}/health", timeout=5).status_code == 200
            if ready >= n:
                break
            assert time.monotonic() < deadline, f"only {ready} of {n} replicas answer after {timeout_s:.0f} s"
            time.sleep(2)
        # the controller marks a replica running when its constructor returns; handles learn by long poll
        time.sleep(3)


def running_requests(url: str) -> float:
    """vLLM's gauge of the requests a server's engine is running now."""
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics", timeout=10).text,
                      re.MULTILINE)  # fmt: skip
    return float(found.group(1)) if found else 0.0


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory, request) -> Iterator[Cluster]:
    port = free_port()
    log = tmp_path_factory.mktemp("spanq-cluster") / "cluster.log"
    # Cold documents prepared alone first on every replica: the routing tests count each document's prepare
    # and compare answers with the session's tiny engine, which prepares them the same way.
    command = [sys.executable, "-m", "spanq_integrations.cli", "serve", "--replicas", "2",
               "--model", str(tiny_model), "--port", str(port), "--cold-spans", "isolate",
               "--api-key", KEY, "--queue-timeout", "10"]  # fmt: skip
    failed_before = request.session.testsfailed
    before = os.environ.get("SPANQ_API_KEY")
    os.environ["SPANQ_API_KEY"] = KEY  # the key `execute(backend="spanq+URL")` sends
    try:
        with running_server(command, log, "spanq serve --replicas 2", api_key=KEY) as proc:
            yield Cluster(f"http://127.0.0.1:{port}", proc.pid, log)
    finally:
        if before is None:
            os.environ.pop("SPANQ_API_KEY", None)
        else:
            os.environ["SPANQ_API_KEY"] = before
    if request.session.testsfailed > failed_before:
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\n--- spanq serve --replicas log (tail of {log}) ---\n{log_tail(log)}")


def _run_all(url: str, queries: list[list[str]], concurrency: int = 1):
    async def go():
        async with SpanBackend(url, api_key=KEY) as backend:
            gate = asyncio.Semaphore(concurrency)

            async def one(docs):
                async with gate:
                    return await backend.execute_remote(rag(docs))

            return await asyncio.gather(*(one(d) for d in queries))

    return asyncio.run(go())


def test_each_span_is_prepared_once_across_the_fleet_and_answers_match_one_engine(cluster, tiny_backend):
    from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE

    queries = workload(12)
    results = _run_all(cluster.url, queries)
    prepared = [r.calls[0].prepared_spans for r in results]
    assert sum(prepared) == len(DOCS), prepared  # each document's span computed on one replica only
    assert all(r.calls[0].cached_tokens > 0 for r in results[2:])
    # (the replicas run at the default recompute setting; the session's tiny backend recomputes nothing unless
    # a query says so)
    expected = [execute(rag(d).model_copy(update={"recompute": DEFAULT_RECOMPUTE}), backend=tiny_backend).answer
                for d in queries[:4]]  # fmt: skip
    assert [r.answer for r in results[:4]] == expected
    # streamed through the ingress too (`SpanBackend.generate`), and concurrent
    streamed = [execute(rag(d), backend=f"spanq+{cluster.url}").answer for d in queries[:2]]
    assert streamed == expected[:2]
    again = _run_all(cluster.url, queries[:4], concurrency=4)
    assert [r.answer for r in again] == expected
    assert sum(r.calls[0].prepared_spans for r in again) == 0


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_the_clusters_metrics_and_spans_speak_for_every_replica(cluster):
    """`GET /metrics` and `GET /v1/spans` on the cluster's address are every replica's, not the one a request
    happened to reach: each sample labelled with its replica, each span held anywhere listed once."""
    cluster.wait_for_replicas(2)
    _run_all(cluster.url, workload(4))  # documents of both pools: the replicas hold different spans
    own_spans = [httpx.get(f"{url}/v1/spans", headers=AUTH, timeout=30).json()["spans"]
                 for url in cluster.replica_urls().values()]  # fmt: skip
    own_tokens = sorted(v for url in cluster.replica_urls().values()
                        for _, v in _samples(httpx.get(f"{url}/metrics", timeout=30).text, "vllm:prompt_tokens_total"))
    gathered = httpx.get(f"{cluster.url}/v1/spans", headers=AUTH, timeout=60)
    assert gathered.status_code == 200, gathered.text
    spans = gathered.json()
    assert len(own_spans) == 2 and len(spans["replicas"]) == 2, spans.get("replicas")
    assert set(spans["spans"]) == set(own_spans[0]) | set(own_spans[1]) and len(set(spans["spans"])) == len(spans["spans"])
    assert sorted(r["spans"] for r in spans["replicas"].values()) == sorted(map(len, own_spans))
    assert httpx.get(f"{cluster.url}/v1/spans", timeout=60).status_code == 401, "the replicas' key check went"
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=60)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    tokens = _samples(metrics.text, "vllm:prompt_tokens_total")
    assert sorted(labels["replica"] for labels, _ in tokens) == sorted(spans["replicas"]), tokens
    assert sorted(v for _, v in tokens) == own_tokens
    assert metrics.text.count("# TYPE vllm:prompt_tokens_total counter") == 1, "a metric family said twice"


def test_bad_input_is_a_4xx_through_the_cluster(cluster):
    bad = {"g": {"model": "", "input": {"cross": [{"user": "hi"}, {"usr": "typo"}]}}}
    answer = httpx.post(f"{cluster.url}{EXECUTE}", json=bad, headers=AUTH, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("$.g.input.cross[1]: ")
    unknown = to_json(generate(user("hi"), model="no-such-model", max_tokens=2))
    assert httpx.post(f"{cluster.url}{EXECUTE}", json=unknown, headers=AUTH, timeout=60).status_code == 404


def test_pinning_through_the_cluster_is_refused_by_name_and_preparing_goes_to_a_replica(cluster):
    """A request reaches one replica: pins taken through the cluster held in that one only (and DELETE was a 405
    from the ingress). Preparing without pins reaches a replica as any request does."""
    spans = f"{cluster.url}/v1/spans"
    for method, url, body in (("POST", spans, {"documents": ["A pinned note."], "pin": True}),
                              ("DELETE", f"{spans}/pin", None)):
        answer = httpx.request(method, url, json=body, headers=AUTH, timeout=60)
        assert answer.status_code == 400, answer.text
        assert "a cluster does not pin documents" in answer.json()["error"]["message"]
    prepared = httpx.post(spans, json={"documents": ["A note prepared on a replica."]}, headers=AUTH, timeout=120)
    assert prepared.status_code == 200 and prepared.json()["spans"] == 1, prepared.text


def test_the_clients_api_key_goes_through_and_any_true_stream_parameter_streams(cluster):
    """The cluster runs with --api-key (each replica's server guards /v1 with it): the client's key goes through
    the ingress (it once kept only the content type: every request was a 401, and the replicas' reports of their
    spans failed too); without it a request is a 401. `?stream=1` streams as `?stream=true` does (the server
    reads both as true; the ingress once buffered the first as a whole answer)."""
    query = to_json(rag(GROUPS[0]))
    assert httpx.post(f"{cluster.url}{EXECUTE}", json=query, timeout=60).status_code == 401
    assert httpx.post(f"{cluster.url}{EXECUTE}", json=query, headers=AUTH, timeout=60).status_code == 200
    long_run = to_json(generate(user("Count to a thousand."), max_tokens=200, temperature=0.0))
    for flag in ("1", "true"):
        started = time.monotonic()
        with httpx.stream("POST", f"{cluster.url}{EXECUTE}", params={"stream": flag}, json=long_run, headers=AUTH,
                          timeout=120) as answer:  # fmt: skip
            assert answer.status_code == 200
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            first_at = time.monotonic() - started
            rest = [line for line in lines if line.startswith("data:")]
        total = time.monotonic() - started
        assert json.loads(first.removeprefix("data: "))["object"] == "chat.completion.chunk"
        assert len(rest) > 10 and first_at < 0.5 * total, (flag, first_at, total)


def test_a_replica_killed_mid_answer_is_routed_around_its_answers_retried_whole_and_it_is_restarted(cluster):
    """Four long answers in flight (no spans: the least busy replica takes each); the server of a replica
    running some of them is killed while they generate; every answer still arrives, whole, from the other (a
    non-streamed answer's body comes only when it is done, so here the server dies before the head; a body cut
    off after its head is retried the same way, in `SpanIngress.relay`). The queries after it, span queries,
    streamed or not, are routed around it; Ray Serve starts a replica in its place."""
    from concurrent.futures import ThreadPoolExecutor

    cluster.wait_for_replicas(2)  # both answering, so that one survives the kill
    long_run = to_json(generate(user("Count to a thousand."), max_tokens=300, temperature=0.0))

    def post() -> httpx.Response:
        return httpx.post(f"{cluster.url}{EXECUTE}", params={"stream": "false"}, json=long_run, headers=AUTH,
                          timeout=300)

    urls = cluster.replica_urls()
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(post) for _ in range(4)]
        deadline = time.monotonic() + 60
        while not any((running := {pid: running_requests(url) for pid, url in urls.items()}).values()):
            assert time.monotonic() < deadline, "no replica started the answers"
            time.sleep(0.2)
        victim = max(running, key=running.__getitem__)  # a replica with answers in flight
        os.kill(victim, signal.SIGKILL)
        results = [a.result() for a in answers]
    assert [r.status_code for r in results] == [200] * 4, [r.text[:200] for r in results]
    assert all(r.json()["usage"]["completion_tokens"] == 300 for r in results)

    queries = workload(4, seed=11)
    after = _run_all(cluster.url, queries)  # each retried on the other replica where its pick died
    assert all(r.answer for r in after)
    streamed = execute(rag(queries[0]), backend=f"spanq+{cluster.url}")
    assert streamed.answer == after[0].answer
    deadline = time.monotonic() + 300
    while not (set(cluster.replica_servers()) - set(urls)):  # a new replica's server, started by Ray Serve
        assert time.monotonic() < deadline, "Ray Serve did not restart the replica"
        time.sleep(2)
    said = re.compile(r"^spanq serve: replicas: .*\b(starting|stopping|recovering)\b.*\(were: 2 running\)$", re.MULTILINE)
    while not said.search(cluster.log.read_text(errors="replace")):  # the console says the replica went
        assert time.monotonic() < deadline, f"the console did not say a replica went:\n{log_tail(cluster.log)}"
        time.sleep(1)


def test_no_replica_reachable_is_a_503_naming_it(cluster):
    for pid in cluster.replica_servers():
        os.kill(pid, signal.SIGKILL)
    answer = httpx.post(f"{cluster.url}{EXECUTE}", json=to_json(rag(GROUPS[0])), headers=AUTH, timeout=120)
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "BackendUnavailableError" and "no replica could answer" in error["message"]
    # Once Ray has dropped the dead replicas (their replacements take ~45 s to load the model), a request finds
    # no replica running: it is answered 503 after --queue-timeout (10 s here), not held until one runs again.
    deadline = time.monotonic() + 90
    while True:
        started = time.monotonic()
        answer = httpx.post(f"{cluster.url}{EXECUTE}", json=to_json(rag(GROUPS[1])), headers=AUTH, timeout=60)
        took = time.monotonic() - started
        assert answer.status_code == 503, answer.text
        if "no replica took the request within 10 s" in answer.json()["error"]["message"]:
            break
        assert time.monotonic() < deadline, f"never answered for want of a running replica: {answer.text}"
        time.sleep(1)
    assert took < 20, f"held {took:.0f} s"


FLAG_CASES = [
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--replicas", "abc"], "--replicas must be a whole number, got 'abc'"),  # ("invalid positive_int value")
    (["--replicas", "2", "--tier-cost", "2"], "--tier-cost must be a number from 0 to 1, got 2"),
    (["--replicas", "2", "--ray-address", "ray://127.0.0.1:1"], "the Ray cluster at 'ray://127.0.0.1:1' does not answer"),
    (["--replicas", "2", "--ray-address", "nowhere"], "'nowhere' is not a Ray cluster address"),
]
@pytest.fixture(scope="module")
def flag_errors() -> dict[str, tuple[int, str]]:
    """Each case's (exit status, stderr), the commands run one after another in one fresh process."""
    from tests.commands import run_in_one_process

    done = run_in_one_process([["serve", "--model", "tiny", *flags] for flags, _ in FLAG_CASES])
    return dict(zip((m for _, m in FLAG_CASES), done))


@pytest.mark.parametrize("flags, message", FLAG_CASES)
def test_cluster_flags_that_cannot_work_are_one_line_errors(flags, message, flag_errors):
    code, stderr = flag_errors[message]
    assert code == 2, stderr
    assert stderr.strip().splitlines()[-1].startswith(f"spanq serve: error: {message}")


def test_a_cluster_on_a_port_another_server_holds_is_refused_before_ray_starts(capsys):
    """Ray Serve's proxy binds with SO_REUSEPORT: a second cluster on a taken port said "ready" and the kernel
    split the connections between the two. And `--replica 2`, which argparse takes for `--replicas 2`, went to
    the single server, which said the cluster extra was missing."""
    import socket

    from spanq_backend.cluster.app import serve_cluster
    from spanq_integrations.cli import _names_replicas

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        assert serve_cluster(["--replicas", "1", "--model", "tiny", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err and time.monotonic() - started < 30
    assert _names_replicas("--replica") and _names_replicas("--replicas=2") and not _names_replicas("--replay")


def test_stopping_the_group_ends_the_cluster_and_all_it_started_even_with_a_replica_down(cluster):
    """Last in this module (it stops the module's cluster). A service manager stops a service by SIGTERM to its
    whole process group (systemd's default, Ray's own processes included); with the replicas' servers gone (the
    test above killed them) Serve's own shutdown waited 30 s for a controller that had lost its cluster, then
    warned. A Ray started by spanq serve goes whole instead: the command exits in seconds, nothing left."""
    from spanq_backend.serving.processes import descendants, processes

    started = sorted({*descendants(cluster.pid), *processes(group=cluster.pid)} - {cluster.pid})
    assert len(started) > 3, "the cluster's own processes (Ray's, the replicas') were not found"
    said = re.search(r"replica logs in (\S+)", cluster.log.read_text())
    assert said, log_tail(cluster.log)
    logs = Path(said.group(1))
    assert len(list(logs.glob("replica-*.log"))) >= 2, "each replica's server log, in the cluster's folder"
    names = {pid: _command(pid) for pid in started}
    os.killpg(cluster.pid, signal.SIGTERM)
    deadline = time.monotonic() + 25  # under Serve's 30 s controller wait
    while time.monotonic() < deadline and os.path.exists(f"/proc/{cluster.pid}") and not _zombie(cluster.pid):
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{cluster.pid}") or _zombie(cluster.pid), (
        f"spanq serve --replicas did not exit within 25 s of a SIGTERM to its group:\n{log_tail(cluster.log)}"
    )
    deadline = time.monotonic() + 10  # what it started follows it out

    def left() -> list[int]:
        return [pid for pid in started if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]

    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), "still running 10 s after the command exited: " + "; ".join(
        f"{pid} {names[pid]}" for pid in left()
    )
    assert not logs.exists(), "the replicas' logs were left behind"  # one folder per run would pile up in /tmp


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
    except OSError:
        return "?"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
