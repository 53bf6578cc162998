"""`spanq serve --replicas N`: N span engines behind one address, on Ray Serve, routed by span affinity.

    client ──HTTP──> Ray Serve proxy ──> SpanIngress ──handle + SpanAffinityRouter──> SpanReplica x N
                                                                                   └─> its own `spanq serve`

Each `SpanReplica` is a Ray Serve replica that starts one `spanq serve` process (the single-engine server, with
every option given to `spanq serve` except the cluster's own) on a free local port, proxies requests to it, and
reports to the router which spans its engine holds (`GET /v1/spans`, read from vLLM's KV cache events). Ray
Serve health-checks each replica (a replica whose server died is restarted) and drops a dead one from routing;
the ingress retries a request whose replica failed before answering on another replica, and a request that was
not streamed also when its replica dies mid-answer. Clients are unchanged: the ingress serves the same routes
(`/v1/query/execute`, `/v1/chat/completions`, `/v1/models`, `/health`, ...) as one `spanq serve`.

`routing="affinity"` uses `SpanAffinityRouter`; `routing="default"` keeps Ray Serve's own (power of two
choices on queue length), for comparison (`spanq bench cluster`), with a replica the ingress saw fail tried last
as affinity routing does (`HealthyFirstRouter`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the route's annotations here

from spanq_backend.cluster.connect import connect
from spanq_backend.cluster.supervise import PARENT_ENV
from spanq_backend.serving.cluster_options import ROUTINGS, TIER_COST, add_cluster_arguments
from spanq_backend.serving.processes import (
    adopt_orphans,
    descendants,
    end_all,
    identities,
    processes,
    reap_adopted,
)
from spanq_backend.serving.request_body import Oversized, body_too_large, read_capped
from spanq_integrations.backends.span import EXECUTE_PATH

__all__ = ["ForwardedRequest", "SpanReplica", "build_app", "free_port", "serve_cluster", "split_cluster_args", "split_cores"]

log = logging.getLogger("spanq.cluster")

ROUTER_CLASS = "spanq_backend.cluster.routing:SpanAffinityRouter"
DEFAULT_ROUTER_CLASS = "spanq_backend.cluster.routing:HealthyFirstRouter"  # Ray Serve's own, failing replicas last
RETRY_PAUSE_S = 0.5  # between tries of a request whose replica failed
GATHER_TIMEOUT_S = 8.0  # how long the cluster's /metrics and /v1/spans wait for all replicas together
END_GRACE_S = 5.0  # on stopping a local Ray: how long what it started has to exit after Ray's shutdown, then killed
CLUSTER_HINT = "spanq serve --replicas needs Ray Serve: pip install 'spanq[cluster]'"


# Headers that belong to one connection, not to the request (RFC 9110 §7.6.1), and those the relay sets itself.
NOT_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                           "transfer-encoding", "upgrade", "host", "content-length", "expect"})  # fmt: skip
TRUE_WORDS = frozenset({"1", "true", "t", "yes", "y", "on"})  # what the server's `stream: bool` parameter reads as true


@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress hands it to a replica."""

    method: str
    path: str
    query: str
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()  # the client's end-to-end headers (its API key among them)
    digests: list[str] | None = field(default=None, compare=False)  # the router's, computed once per request
    replica: str | None = None  # the one replica it is for (the ingress's reads of every replica), else routed

    @property
    def span_body(self) -> bytes | None:
        """The span query the router routes on (None for other routes)."""
        return self.body if self.method == "POST" and self.path == EXECUTE_PATH else None

    @property
    def streams(self) -> bool:
        """Whether the answer is a stream (an SSE answer is relayed as it comes, not buffered): `?stream=` as the
        server reads it (true, 1, yes, on, ...), or `"stream": true` in a JSON body."""
        from urllib.parse import parse_qs

        if any(v.strip().lower() in TRUE_WORDS for v in parse_qs(self.query).get("stream", ())):
            return True
        body = self.body.lstrip()
        if self.content_type.lower().startswith("application/json") and body[:1] == b"{":
            with contextlib.suppress(ValueError, RecursionError):
                return json.loads(body).get("stream") is True
        return False


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value given to `flag` in a command line (`--flag V` or `--flag=V`; the last one given), or None."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    return found


def _limits(max_body_bytes: int) -> Any:
    from spanq_integrations.query.limits import QueryLimits

    return QueryLimits(max_body_bytes=max_body_bytes)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class SpanReplica:
    """One span engine of the cluster: a `spanq serve` process it owns, proxied (a Ray Serve deployment)."""

    def __init__(
        self,
        serve_args: Sequence[str],
        core_lists: Sequence[str] = (),
        start_timeout_s: float = 900.0,
        log_dir: str | None = None,
    ):
        import httpx
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.to_full_id_str()
        env = dict(os.environ)
        if core_lists:  # this replica's share of the machine's cores, by its rank on the node
            rank = getattr(context.rank, "local_rank", 0) or 0
            env["VLLM_CPU_OMP_THREADS_BIND"] = core_lists[rank % len(core_lists)]
        self.cores = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        env[PARENT_ENV] = str(os.getpid())  # (the supervisor ends at once if this replica died before it was up)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # In the cluster's log folder where it gave one (a local Ray: `serve_cluster` removes it when it ends);
        # else in one of its own, on whatever machine the replica runs.
        if log_dir is not None:
            tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", context.replica_id.unique_id)
            self.log_path = Path(log_dir) / f"replica-{tag}.log"
        else:
            self.log_path = Path(tempfile.mkdtemp(prefix="spanq-replica-")) / "serve.log"
        # Through `supervise`: the server and its engine core live and die together, as one process group.
        command = [sys.executable, "-m", "spanq_backend.cluster.supervise",
                   sys.executable, "-m", "spanq_integrations.cli", "serve", *serve_args,
                   "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"spanq serve exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"spanq serve did not answer within {start_timeout_s:.0f} s:\n{_tail(self.log_path)}")
            time.sleep(0.5)
        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10))
        # The key its server guards /v1 with (`--api-key`, or vLLM's VLLM_API_KEY): for the replica's own reads
        # of /v1/spans only; a client's requests go with the client's own Authorization, or none.
        key = flag_value(serve_args, "--api-key") or env.get("VLLM_API_KEY")
        self._own_headers = {"Authorization": f"Bearer {key}"} if key else {}
        log.info("replica ready: spanq serve on %s, cores %s (log %s)", self.url, self.cores, self.log_path)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[Any]:
        """Relay one request: first `{"taken": replica id}` (at once: the ingress knows a replica has it), then
        `{"status", "content_type"}` (or `{"unavailable": reason}` if the server did not answer), then the body's
        chunks."""
        import httpx

        yield {"taken": self.replica_id}
        url = request.path + (f"?{request.query}" if request.query else "")
        headers = dict(request.headers)
        if request.content_type:
            headers["content-type"] = request.content_type
        try:
            async with self.client.stream(request.method, url, content=request.body, headers=headers) as answer:
                yield {"status": answer.status_code, "content_type": answer.headers.get("content-type", "")}
                async for chunk in answer.aiter_raw():
                    yield chunk
        except httpx.TransportError as e:
            yield {"unavailable": f"replica {self.url}: {type(e).__name__}: {e}", "replica": self.replica_id}
            # (before the head: the ingress retries elsewhere; after it: it retries a whole answer, or ends a stream)

    async def record_routing_stats(self) -> dict[str, Any]:
        """For the router: the digests of the spans this replica's engine holds, and with a span tier, of those the
        tier holds and which folder it is."""
        answer = await self.client.get("/v1/spans", timeout=10, headers=self._own_headers)
        answer.raise_for_status()
        spans = answer.json()
        return {"spans": spans.get("spans", []), "tier": spans.get("tier", []), "tier_id": spans.get("tier_id")}

    async def check_health(self) -> None:
        if self.proc.poll() is not None:
            self._stop()  # whatever of its process group is left
            raise RuntimeError(f"spanq serve exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
        answer = await self.client.get("/health", timeout=10)
        if answer.status_code != 200:
            raise RuntimeError(f"spanq serve's /health answered {answer.status_code}")

    def _stop(self) -> None:
        """Stop the server and its engine (its own process group, which outlives a killed leader)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None:
            self._stop()


async def _whole_body(chunks: Any) -> bytes:
    """The rest of a replica's answer (after its head), whole; a `ConnectionError` where its server went away
    mid-answer (the replica marked failing: the router tries the others first)."""
    from spanq_backend.cluster.policy import mark_failing

    parts: list[bytes] = []
    async for chunk in chunks:
        if isinstance(chunk, dict):
            if "replica" in chunk:
                mark_failing(chunk["replica"])
            raise ConnectionError(chunk.get("unavailable", "the replica stopped mid-answer"))
        parts.append(chunk)
    return b"".join(parts)


def _error(status: int, kind: str, message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def _relay_stream(chunks: Any) -> AsyncIterator[bytes]:
    """A replica's streamed answer, ended by an error event if the replica goes away mid-stream."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        async for chunk in chunks:
            if isinstance(chunk, dict):  # the replica's server went away mid-stream
                raise ConnectionError(chunk.get("unavailable", "the replica stopped"))
            yield chunk
    except (ConnectionError, RayActorError, RayTaskError) as e:
        error = {"error": {"message": f"the replica stopped mid-answer: {e}", "type": "BackendUnavailableError",
                           "code": 503}}  # fmt: skip
        yield f"data: {json.dumps(error)}\n\n".encode()


PINS_ON_A_CLUSTER = (
    "a cluster does not pin documents in its replicas' caches: a request reaches one replica, so the pins would "
    "hold in that one only. Compile the corpus into the replicas' shared tier (spanq prepare CORPUS --tier-dir DIR "
    "--pin: every replica loads it from there), or pin through each replica's own address"
)


def _pins_replica_cache(method: str, path: str, body: bytes) -> bool:
    """Whether a request would pin (or unpin) documents in the cache of the one replica it reaches."""
    path = path.strip("/")
    if path == "v1/spans/pin":
        return method != "GET"
    if path == "v1/spans" and method == "POST":
        try:
            return json.loads(body).get("pin") is True
        except (ValueError, AttributeError):
            return False  # the replica names what is wrong with it
    return False


def _make_ingress(retries: int, max_body_bytes: int, queue_timeout_s: float) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from ray import serve
    from ray.exceptions import RayActorError, RayTaskError

    from spanq_backend.cluster.gather import GATHERED, merge_metrics, merge_spans, short_id
    from spanq_backend.cluster.policy import mark_failing, running_replicas

    app = FastAPI(title="spanq cluster")
    replica_failures = (RayActorError, RayTaskError, ConnectionError)

    @serve.ingress(app)
    class SpanIngress:
        """Every route, relayed to a span replica chosen by the deployment's router."""

        def __init__(self, replicas: Any):
            self.replicas = replicas.options(stream=True)

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def relay(self, path: str, request: Request) -> Any:
            body = await read_capped(request, max_body_bytes)
            if isinstance(body, Oversized):  # the replicas' own 400 (`spanq serve`'s query route), said here
                refused = body_too_large(_limits(max_body_bytes), body)
                return _error(400, type(refused).__name__, str(refused))
            if _pins_replica_cache(request.method, path, body):
                return _error(400, "RequestRejectedError", PINS_ON_A_CLUSTER)
            forwarded = ForwardedRequest(
                method=request.method,
                path="/" + path,
                query=request.url.query,
                content_type=request.headers.get("content-type", ""),
                body=body,
                headers=tuple((k, v) for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED),
            )
            if request.method == "GET" and path.strip("/") in GATHERED:
                gathered = await self.gather(path.strip("/"), forwarded, request.headers)
                if gathered is not None:
                    return gathered
            last = "no replica is running"
            for _ in range(retries + 1):
                chunks = self.replicas.forward.remote(forwarded)
                try:
                    # Ray Serve waits without end for a replica to take a request (none running: all restarting,
                    # or none able to start; all at max_ongoing_requests): bounded here.
                    try:
                        await asyncio.wait_for(chunks.__anext__(), timeout=queue_timeout_s)
                    except TimeoutError:
                        chunks.cancel()
                        return _error(503, "BackendUnavailableError", f"no replica took the request within "
                                      f"{queue_timeout_s:g} s (none is running, or all are at their limit of "
                                      "requests); spanq serve --queue-timeout sets the wait")
                    head = await chunks.__anext__()
                    if "unavailable" in head:
                        last = head["unavailable"]
                        mark_failing(head["replica"])  # the router tries the others first
                        await asyncio.sleep(RETRY_PAUSE_S)
                        continue
                    if not forwarded.streams:  # whole, so that a replica lost mid-answer is retried
                        body = await _whole_body(chunks)
                        return Response(body, status_code=head["status"], media_type=head["content_type"] or None)
                except (StopAsyncIteration, *replica_failures) as e:
                    last = f"{type(e).__name__}: {e}"
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                return StreamingResponse(
                    _relay_stream(chunks), status_code=head["status"], media_type=head["content_type"] or None
                )
            return _error(503, "BackendUnavailableError", f"no replica could answer after {retries + 1} tries: {last}")

        async def ask(self, forwarded: ForwardedRequest, timeout_s: float) -> tuple[int, str, bytes]:
            """One replica's whole answer to a request addressed to it: (status, content type, body); an exception
            where it did not answer within `timeout_s`."""
            chunks = self.replicas.forward.remote(forwarded)
            try:
                async with asyncio.timeout(timeout_s):
                    await chunks.__anext__()  # taken
                    head = await chunks.__anext__()
                    if "unavailable" in head:
                        mark_failing(head["replica"])
                        raise ConnectionError(head["unavailable"])
                    body = await _whole_body(chunks)
            except TimeoutError:
                chunks.cancel()
                raise TimeoutError(f"no answer within {timeout_s:.1f} s") from None
            return head["status"], head["content_type"], body

        async def gather(self, path: str, forwarded: ForwardedRequest, headers: Any) -> Any:
            """`GET /metrics` or `GET /v1/spans` asked of every running replica and merged (`gather.py`), within
            one deadline (a scrape's own, from Prometheus's header, else `GATHER_TIMEOUT_S`): a replica that does
            not answer in time is named (a comment in the metrics, `unanswered` in the spans); a status every
            replica gives alike (401 without the API key) is theirs. None where no replica is known yet."""
            budget = GATHER_TIMEOUT_S
            with contextlib.suppress(TypeError, ValueError):
                budget = min(budget, 0.9 * float(headers.get("x-prometheus-scrape-timeout-seconds")))
            deadline = time.monotonic() + budget
            # the path as the replica's routes have it; the body as it is (a compressed one would be opaque here)
            plain = (*((k, v) for k, v in forwarded.headers if k.lower() != "accept-encoding"), ("accept-encoding", "identity"))
            forwarded = dataclasses.replace(forwarded, path="/" + path, headers=plain)
            if not running_replicas():  # the handle's router starts with its first request, then hears of them
                with contextlib.suppress(Exception):
                    await self.ask(dataclasses.replace(forwarded, path="/health", query=""), budget / 2)
                while not running_replicas() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                if not running_replicas():
                    return None
            # One after another: Ray Serve's router matches a chosen replica to a waiting request by the HTTP
            # request's id, which concurrent calls under one request share (one got the other's replica; the
            # other waited for ever). Each replica is looked up again before it is asked: one gone since is
            # not asked (the router would have no such replica to send it to).
            answers: dict[str, tuple[int, str, bytes] | str] = {}
            for rid in running_replicas():
                if rid not in running_replicas():
                    continue
                left = deadline - time.monotonic()
                if left <= 0.05:
                    answers[rid] = "not asked: the time to answer was spent"
                    continue
                try:
                    answers[rid] = await self.ask(dataclasses.replace(forwarded, replica=rid), left)
                except Exception as e:  # noqa: BLE001 - the replica is named in the answer, the others still asked
                    answers[rid] = " ".join(f"{type(e).__name__}: {e}".split())  # (one line: a comment of the metrics)
            bodies = {rid: a[2] for rid, a in answers.items() if not isinstance(a, str) and a[0] == 200}
            unanswered = {short_id(rid): a if isinstance(a, str) else f"HTTP {a[0]}"
                          for rid, a in answers.items() if rid not in bodies}  # fmt: skip
            refusals = [a for a in answers.values() if not isinstance(a, str)]
            if not bodies and refusals and len({a[0] for a in refusals}) == 1:  # all refused it alike: theirs
                status, content_type, body = refusals[0]
                return Response(body, status_code=status, media_type=content_type or None)
            if not bodies:
                return _error(503, "BackendUnavailableError", f"no replica answered {path}: {unanswered}")
            try:
                if path == "metrics":
                    text = merge_metrics({rid: b.decode("utf-8") for rid, b in bodies.items()})
                    notes = "".join(f"# spanq: replica {r} did not answer: {why}\n" for r, why in unanswered.items())
                    return Response(notes + text, media_type="text/plain; version=0.0.4; charset=utf-8")
                merged = merge_spans({rid: json.loads(b) for rid, b in bodies.items()})
            except (ValueError, UnicodeDecodeError, AttributeError) as e:
                return _error(502, "BackendError", f"a replica's {path} could not be read: {e}")
            if unanswered:
                merged["unanswered"] = unanswered
            return JSONResponse(merged)

    return SpanIngress


def split_cores(replicas: int, cores: Sequence[int] | None = None) -> list[str]:
    """The machine's cores (those this process may use) in `replicas` contiguous shares, as vLLM's CPU binding
    lists ("0-3"), one per replica on this node; [] (each engine binds as vLLM decides) if the user set
    `VLLM_CPU_OMP_THREADS_BIND`, or there are fewer cores than replicas. Replicas on one machine that all bind
    the same cores compute in turn (vLLM's own choice, `auto`, binds every engine to the same ones)."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return []
    ids = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if replicas < 1 or len(ids) < replicas:
        return []
    share, extra = divmod(len(ids), replicas)
    lists, start = [], 0
    for r in range(replicas):
        n = share + (r < extra)
        part = ids[start : start + n]
        start += n
        if len(part) == 1:
            lists.append(str(part[0]))
        elif part == list(range(part[0], part[-1] + 1)):
            lists.append(f"{part[0]}-{part[-1]}")
        else:
            lists.append(",".join(map(str, part)))
    return lists


def build_app(
    serve_args: Sequence[str],
    replicas: int,
    routing: str = "affinity",
    *,
    core_lists: Sequence[str] = (),
    max_imbalance: int = 4,
    tier_cost: float = TIER_COST,
    stats_period_s: float = 1.0,
    retries: int = 2,
    max_ongoing_requests: int = 64,
    log_dir: str | None = None,
    queue_timeout_s: float = 60.0,
) -> Any:
    """The Ray Serve application: the ingress bound to `replicas` span replicas (each writes its server's log into
    `log_dir` where given, else into a folder of its own)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r} (one of: {', '.join(ROUTINGS)})")
    router = (
        RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"max_imbalance": max_imbalance, "tier_cost": tier_cost},
            request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * stats_period_s),
        )
        if routing == "affinity"
        else RequestRouterConfig(request_router_class=DEFAULT_ROUTER_CLASS)
    )
    replica = serve.deployment(
        SpanReplica,
        name="SpanReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},  # the engines use the cores; Ray's scheduler need not count them
        health_check_period_s=2,
        health_check_timeout_s=30,
        request_router_config=router,
    ).bind(list(serve_args), list(core_lists), log_dir=log_dir)
    from spanq_integrations.query.limits import DEFAULT_LIMITS

    given = flag_value(serve_args, "--max-body-bytes")  # the replicas' own limit: the ingress holds no more
    max_body_bytes = int(given) if given and given.isdigit() else DEFAULT_LIMITS.max_body_bytes
    ingress = serve.deployment(
        _make_ingress(retries, max_body_bytes, queue_timeout_s), name="SpanIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
    )  # fmt: skip
    return ingress.bind(replica)


def split_cluster_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """`spanq serve`'s cluster options, and the rest (each replica's own `spanq serve` options; --host and
    --port are the cluster's address)."""
    parser = _RaisingParser(add_help=False)
    add_cluster_arguments(parser)  # the same definitions `spanq serve --help` shows
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    cluster, rest = parser.parse_known_args(list(argv))
    return cluster, rest


class _RaisingParser(argparse.ArgumentParser):
    """A bad value is a ValueError naming it (the command prints it in one line), not argparse's exit."""

    def error(self, message: str) -> Any:
        raise ValueError(re.sub(r"^argument (\S+?)(/\S+)?: ", r"\1 ", message))  # "--replicas must be ..."


def serve_cluster(argv: Sequence[str]) -> int:
    """`spanq serve --replicas N [--routing affinity|default] [--ray-address ADDR] ...`: run until interrupted."""
    try:
        cluster, rest = split_cluster_args(argv)
        from ray import serve
    except ImportError:
        print(f"spanq serve: error: {CLUSTER_HINT}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"spanq serve: error: {e}", file=sys.stderr)
        return 2
    # A Ray started here is this command's to end whole: whatever it starts (Ray's processes, the replicas'
    # servers and engine cores) stays among this process's descendants when a process between them dies first.
    if not cluster.ray_address and (taken := _port_taken(cluster.host, cluster.port)) is not None:
        print(f"spanq serve: error: cannot listen on {cluster.host}:{cluster.port} ({taken}): another server is "
              "there; give another --port", file=sys.stderr)
        return 2
    adopted = not cluster.ray_address and adopt_orphans()
    try:
        connect(cluster.ray_address)
    except ConnectionError as e:
        print(f"spanq serve: error: {e}", file=sys.stderr)
        return 2
    own = set(processes(parent=os.getpid()))  # Ray's own processes: their exits are Ray's to collect
    stop = asyncio.Event()
    stopping = threading.Event()  # for the console's watch of the replicas
    log_dir: str | None = None
    # A SIGTERM while the replicas start (a service manager's stop, a deploy's timeout) stops the start-up as a
    # Ctrl-C does, through the cleanup below: it killed this process at once (Ray's core printed its stack dump)
    # and left the replicas' log folder behind.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": cluster.host, "port": cluster.port})
        # on a local Ray every replica runs on this machine: each gets its own cores (a remote cluster's nodes are
        # not known here; there each engine binds as vLLM decides, or as VLLM_CPU_OMP_THREADS_BIND says)
        cores = split_cores(cluster.replicas) if not cluster.ray_address else []
        # A local Ray's replicas write their servers' logs here; the folder goes when this command ends (a replica
        # killed with Ray cannot remove its own).
        log_dir = None if cluster.ray_address else tempfile.mkdtemp(prefix="spanq-cluster-")
        app = build_app(rest, cluster.replicas, cluster.routing, core_lists=cores, max_imbalance=cluster.max_imbalance,
                        tier_cost=cluster.tier_cost, log_dir=log_dir, queue_timeout_s=cluster.queue_timeout)  # fmt: skip
        print(
            f"spanq serve: starting {cluster.replicas} replica(s), {cluster.routing} routing, on "
            f"http://{cluster.host}:{cluster.port}" + (f"; their engines' cores: {' | '.join(cores)}" if cores else "")
            + (f"; replica logs in {log_dir}" if log_dir else ""),
            file=sys.stderr,
            flush=True,
        )
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except Exception as e:  # noqa: BLE001 - a replica that cannot start: its server's log tail is in the error
            print(f"spanq serve: error: the replicas did not start: {e}", file=sys.stderr)
            if not cluster.ray_address:  # (on someone else's cluster, `finally` takes spanq's application off)
                serve.shutdown()
            return 1
        if cluster.ray_address and _local_ray(cluster.ray_address) and not _answers_on(cluster.host, cluster.port):
            print(f"spanq serve: error: the cluster does not answer on port {cluster.port}: Ray Serve already ran "
                  "there, and its HTTP address is fixed when it starts (Ray's warning above names the field); give "
                  "that port with --port, or start spanq on a cluster without Serve", file=sys.stderr, flush=True)
            return 1  # (`finally` takes spanq's application off)
        print(f"spanq serve: ready on http://{cluster.host}:{cluster.port}", file=sys.stderr, flush=True)

        def on_signal(*_: Any) -> None:
            stopping.set()
            stop.set()

        async def wait() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=5.0)
                if adopted:
                    reap_adopted(own)  # a restarted replica's supervisor, say: not left a zombie

        # (on a thread of its own that the exit does not wait for: Serve's status call waits without bound on a
        # controller the stop is taking down)
        threading.Thread(target=watch_replicas, args=(serve, stopping), daemon=True).start()
        asyncio.run(wait())
    except KeyboardInterrupt:  # (Ctrl-C, or the SIGTERM above, before the replicas were ready)
        print("spanq serve: stopped while the replicas were starting", file=sys.stderr, flush=True)
    finally:
        stopping.set()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import ray

        if cluster.ray_address:  # someone else's cluster: only this application off it (Serve's shutdown removed
            with contextlib.suppress(Exception):  # every application there, the others' too)
                serve.delete(APP_NAME)
        # A Ray started here goes whole, replicas with it (each replica's server follows its actor out). Serve's
        # own shutdown first would wait on a controller whose cluster a Ctrl-C (the whole process group) is
        # taking down: 30 s, then a warning.
        ray.shutdown()
        if adopted:  # and within a bound: what is still there `END_GRACE_S` later is killed
            end_all(identities(descendants(os.getpid())), grace_s=END_GRACE_S)
        if log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def watch_replicas(serve: Any, stopping: threading.Event, every_s: float = 5.0) -> None:
    """Say on the console when the replicas' states change (one failed and restarts, it is back), until
    `stopping` is set."""
    said = replica_states(serve)
    while not stopping.wait(every_s):
        now = replica_states(serve)
        if now and now != said and not stopping.is_set():
            print(f"spanq serve: replicas: {now}" + (f" (were: {said})" if said else ""), file=sys.stderr, flush=True)
            said = now


def replica_states(serve: Any) -> str:
    """How many of the cluster's replicas are in each state, as Ray Serve says ("2 running", "1 running, 1
    starting"); empty where Serve does not answer."""
    try:
        states = serve.status().applications[APP_NAME].deployments["SpanReplica"].replica_states
        counts = sorted((str(getattr(state, "value", state)).lower(), int(n)) for state, n in states.items() if n)
    except Exception:  # noqa: BLE001 - the controller busy or gone: nothing to say this time (never the cluster's end)
        return ""
    return ", ".join(f"{n} {state}" for state, n in counts)


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


APP_NAME = "spanq"  # the Serve application's name on its cluster


def _local_ray(address: str) -> bool:
    """Whether a Ray address names a cluster on this machine ("auto", or a loopback head): its Serve proxy
    listens here. A remote head's proxy listens on that machine, whose address spanq is not given."""
    host = address.removeprefix("ray://").rpartition(":")[0] or address
    return address == "auto" or host in ("localhost", "127.0.0.1", "::1")


def _port_taken(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (something listens there already), or None. Ray Serve's proxy binds with
    SO_REUSEPORT, so a second cluster on a taken port started "ready" and the kernel shared the connections out
    between the two."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a closed server's TIME_WAIT is no owner)
            probe.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def _answers_on(host: str, port: int, timeout_s: float = 10.0) -> bool:
    """Whether spanq's application answers `/health` at host:port (a wildcard host is asked on loopback). On a
    cluster whose Serve already ran, Serve keeps its own HTTP address and ignores `--port`."""
    import httpx

    asked = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(f"http://{asked}:{port}/health", timeout=2).status_code == 200
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                return False
        except httpx.HTTPError:
            return True  # something answers there, slowly: not refused
        time.sleep(0.5)


serve_main = serve_cluster  # `spanq serve --replicas ...` (the command line's name for it)
