"""`spanq serve`: vLLM's OpenAI-compatible server with the span plugin, plus `POST /v1/query/execute`.

The stock routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/metrics`) are vLLM's own. The
span plugin loads through its entry point in the engine core process, so the hooks work there as they do in
the embedded engine. This module is the command: its options and defaults, and starting vLLM's server with
spanq's routes mounted. The routes are `serving/query_route.py`; the backend they run queries on,
`serving/engine_client.py`.

    spanq serve [--model default|tiny|PATH] [--host 127.0.0.1] [--port 8000] [other `vllm serve` options]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from spanq_backend.serving.cluster_options import (
    CLUSTER_ONLY,
    ROUTINGS,
    add_cluster_arguments,
    positive_int,
)
from spanq_backend.serving.engine_defaults import ENGINE_DEFAULTS, cpu_env_defaults, on_cpu, platform_defaults
from spanq_backend.serving.generator import (
    ISOLATE_MIN_TOKENS,
    ISOLATE_MIN_TOKENS_RECOMPUTING,
    LEAD_IN_NEUTRAL,
    load_chat_tokenizer,
)
from spanq_backend.serving.lowering import DEFAULT_ANCHOR
from spanq_backend.serving.processes import ExitGuard
from spanq_backend.serving.query_route import build_query_router
from spanq_backend.serving.recompute import DEFAULT_RECOMPUTE, recompute_arg
from spanq_integrations.query.errors import SpanQueryError
from spanq_integrations.query.ir import ANCHOR_POLICIES, COLD_SPAN_POLICIES
from spanq_integrations.query.limits import DEFAULT_LIMITS, QueryLimits

__all__ = ["ROUTINGS", "SERVE_DEFAULTS", "add_cluster_arguments", "parse_serve_args", "serve_main"]

log = logging.getLogger("spanq.server")

# `spanq serve` defaults; every one can be overridden on the command line. The engine's are the embedded engine's
# too (`serving/engine_defaults.py`); the CPU ones apply on a CPU only.
SERVE_DEFAULTS: dict[str, Any] = {
    **ENGINE_DEFAULTS,
    "host": "127.0.0.1",
    "port": 8000,
    "enable_prompt_tokens_details": True,  # stock routes report cached tokens too
}


# --------------------------------------------------------------------------------------------- the command


def limits_of(args: argparse.Namespace) -> QueryLimits:
    """The query limits `spanq serve` was started with."""
    return QueryLimits(**{name: getattr(args, f"spanq_{name}") for name in DEFAULT_LIMITS.describe()})


# vLLM's help formatter appends "(default: X)" to every option whose help does not show its default itself; this
# shows it as nothing, where X would mislead ("True" for a --no- flag, "None" for no limit).
NO_DEFAULT_SHOWN = "%(default).0s"


_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-(inf|nan)", re.IGNORECASE)


def joined_negative_values(argv: Sequence[str]) -> list[str]:
    """`--option -0.1` as `--option=-0.1`: vLLM's parser reads a token that starts with "-" and holds a dot as a
    dotted option (`--json-arg.key`), so a negative decimal after an option failed with an IndexError from inside
    it, or took the next option as its value; joined, the option's own check names what is wrong with it."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_NUMBER.fullmatch(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """`vllm serve`'s arguments with spanq's defaults; `--model default|tiny|PATH` resolved to a folder."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from spanq_backend.serving.models import served_names

    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="spanq serve",
            description="vLLM's OpenAI-compatible server with span-aware KV reuse and POST /v1/query/execute. "
            "--model takes default (SmolLM2-135M-Instruct), tiny, tiny-<family>, a model folder or a Hugging Face "
            "id (from the local cache, else downloaded unless HF_HUB_OFFLINE=1); every other `vllm serve` option passes through. spanq's own options: "
            "--help=spanq; the query limits: --help=limits; several replicas: --help=cluster; everything: --help=all.",
        )
    )
    limits = parser.add_argument_group(
        "limits", "spanq's query limits: what one POST /v1/query/execute may ask for; a query over a limit is a 400 "
        "naming it"
    )
    for name, default in DEFAULT_LIMITS.describe().items():
        limits.add_argument(f"--{name.replace('_', '-')}", dest=f"spanq_{name}", type=positive_int, default=default,
                            metavar="N", help=f"the most {QueryLimits.meaning(name)}")
    spanq = parser.add_argument_group(
        "spanq", "spanq's own options: how documents are read as spans, cold documents, recompute, the span tier, logs"
    )
    spanq.add_argument(
        "--span-anchor", dest="spanq_span_anchor", choices=ANCHOR_POLICIES, default=DEFAULT_ANCHOR,
        help="what a document's KV is computed after when its plus names no anchor: template (reused after any "
        "prefix, the default), system (after the query's system prompt), prefix (exact, after the same prefix)",
    )
    spanq.add_argument(
        "--span-lead-in", dest="spanq_span_lead_in", default=LEAD_IN_NEUTRAL, metavar="neutral|auto|none|TEXT",
        help="what a template or system anchor reads before each document, as if other documents came first: "
        "neutral (the default: eight short passages of plain prose, the same on every server), auto (the start of "
        "the first document the server reads, kept: closer to full attention, but answers then depend on which "
        "document came first, so replicas differ), none, or a text",
    )
    spanq.add_argument(
        "--cold-spans", dest="spanq_cold_spans", choices=COLD_SPAN_POLICIES, default="auto",
        help="documents not cached yet: as their size says (auto, the default: isolate from --isolate-min-tokens "
        f"cold tokens, {ISOLATE_MIN_TOKENS} by default, {ISOLATE_MIN_TOKENS_RECOMPUTING} at least for a query that "
        "recomputes blocks, else context); prepared alone first, so the first answer "
        "is the one every later query gets (isolate: faster than stock on large cold prompts, slower on small "
        "ones); computed in context by the query as stock vLLM would, and prepared alone when the engine is idle "
        "(context: a stock answer first, at stock's speed, span answers after)",
    )
    spanq.add_argument(
        "--no-read-in-context", dest="spanq_read_in_context", action="store_false",
        help="always read documents as spans; by default a query whose documents the cache holds in context (an "
        "earlier query read them so, in some order) is read in that order as stock reads it, where that computes "
        "at most a block more than the spans: stock's speed and full attention's answer" + NO_DEFAULT_SHOWN,
    )
    spanq.add_argument(
        "--keep-span-order", dest="spanq_keep_span_order", action="store_true",
        help="read a group's documents in the order given; by default a group is read in one order per set of "
        "documents (a plus is order-free: by a digest of each text, the one whose last partial block is shortest "
        "last), so the same documents asked about again are not relocated and a query computes fewer tokens, at "
        "answers a little further from a stock answer in the given order (docs/benchmarks.md, 'One order per set')",
    )
    spanq.add_argument(
        "--isolate-min-tokens", dest="spanq_isolate_min_tokens", type=positive_int, default=ISOLATE_MIN_TOKENS,
        metavar="N", help="--cold-spans auto: cold document tokens from which they are prepared alone first (a "
        f"query that recomputes blocks, as the default does: from {ISOLATE_MIN_TOKENS_RECOMPUTING} at least)",
    )
    spanq.add_argument(
        "--recompute", dest="spanq_recompute", type=recompute_arg, default=DEFAULT_RECOMPUTE, metavar="SETTING",
        help="span blocks recomputed in context for quality when a query says nothing: first+question (the "
        "default: each span's first block and as many more, those the question shares most with), question (as "
        "many blocks as spans, those the question shares most with: half the recompute), none (raw span speed), "
        "first, last (each span's first / last block), attention (as many blocks, those the question attends to most, read by a pass "
        "of its own first), or a share of span blocks such as 0.1",
    )
    spanq.add_argument(
        "--tier-dir", dest="spanq_tier_dir", default=None, metavar="DIR",
        help="a span tier: a folder where span KV outlives the server (spans this server prepares are saved there; "
        "spans found there, by this server, another replica or `spanq prepare`, are loaded instead of computed; "
        "none by default)" + NO_DEFAULT_SHOWN,
    )
    spanq.add_argument(
        "--tier-max-gb", dest="spanq_tier_max_gb", type=float, default=None, metavar="GB",
        help="with --tier-dir: the tier's capacity; past it the least recently used blocks not pinned (`spanq "
        "prepare --pin`) are removed (default: no limit)" + NO_DEFAULT_SHOWN,
    )
    spanq.add_argument(
        "--verbose", dest="spanq_verbose", action="store_true",
        help="show vLLM's INFO log lines (by default its warnings and errors only; or set SPANQ_LOG_LEVEL)",
    )  # fmt: skip
    add_cluster_arguments(parser)  # shown in --help; they take effect only with --replicas (the cluster)
    parser.set_defaults(**{**SERVE_DEFAULTS, **platform_defaults()})  # the CPU settings on a CPU only
    args = parser.parse_args(joined_negative_values(argv))
    given = [flag for flag in CLUSTER_ONLY if any(a == flag or a.startswith(f"{flag}=") for a in argv)]
    if given and args.replicas is None:
        raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --replicas N (several engines)")
    if args.replicas is not None:
        raise ValueError("write --replicas in full (--replicas N: an abbreviation of it is not read as the cluster's "
                         "option), and install the cluster extra if need be: pip install 'spanq[cluster]'")
    if not 0 <= args.port <= 65535:  # (the socket's own OverflowError came after the model was loaded)
        raise ValueError(f"--port must be a port number, 0-65535; got {args.port}")
    if args.headless or args.grpc or (args.api_server_count or 1) != 1:
        raise ValueError(
            "spanq serve runs one HTTP API server: --headless, --grpc and --api-server-count are not supported"
        )
    if args.enable_prefix_caching is False:
        raise ValueError("--no-enable-prefix-caching turns span reuse off (spans are read from the prefix cache): "
                         "leave it out, or serve stock vLLM")
    if args.spanq_tier_dir is not None:
        from spanq_backend.vllm_integration import tier

        if args.kv_transfer_config is not None:
            raise ValueError("--tier-dir is served through vLLM's KV connector: --kv-transfer-config cannot be given too")
        capacity = tier.gb_to_bytes(args.spanq_tier_max_gb)  # (checked before the folder is made)
        tier.check_tier_dir(args.spanq_tier_dir)  # a TierError is a ValueError: reported below
        args.kv_transfer_config = tier.transfer_config(args.spanq_tier_dir, capacity)
    elif args.spanq_tier_max_gb is not None:
        raise ValueError("--tier-max-gb is the capacity of a span tier: give --tier-dir too")
    spec = args.model_tag or args.model
    from spanq_backend.serving.admission import admit

    # As `SpanEngine` admits it: an unknown name, an architecture vLLM does not run, a model spans are refused on
    # (all ValueErrors) are refused here, in one line, before vLLM starts.
    admitted = admit(spec, spans=True)
    path = admitted.path
    if args.disable_hybrid_kv_cache_manager is None:
        args.disable_hybrid_kv_cache_manager = admitted.disable_hybrid_kv_cache_manager
    args.model, args.model_tag = str(path), None
    if not args.served_model_name:
        # Answer to the name the server was started with (`tiny`, a folder, a hub id) as well as the folder's:
        # /v1/models lists them all, the query route and the OpenAI routes accept any (or none).
        args.served_model_name = served_names(spec, path)
    if args.kv_events_config is None:
        # vLLM's KV cache events on a private socket: the query route follows the prefix cache through them
        # and skips prepare requests for spans already cached (`cache_probe.KVEventsMirror`).
        from vllm.config.kv_events import KVEventsConfig

        socket_path = kv_events_socket_path()
        args.kv_events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", topic="spanq-kv", endpoint=f"ipc://{socket_path}"
        )
    return args


KV_SOCKET_PREFIX = "spanq-kv-"


def kv_events_socket_path() -> str:
    """A new Unix socket path for a server's KV cache events, `<tmp>/spanq-kv-<pid>-<random>`.

    The socket's file goes when its server exits, unless the server was killed (SIGKILL, the OOM killer): so the
    folder is swept first of the sockets such servers left (`sweep_stale_kv_sockets`)."""
    import os
    import tempfile
    import uuid

    folder = tempfile.gettempdir()
    if len(folder) > 60:  # a Unix socket path holds at most ~107 bytes
        folder = "/tmp"
    sweep_stale_kv_sockets(folder)
    return f"{folder}/{KV_SOCKET_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def sweep_stale_kv_sockets(folder: str) -> list[str]:
    """Remove, from `folder`, the KV-event sockets of servers that are gone; return their paths.

    A socket is stale only if both hold: the process its name carries no longer exists, and nothing listens on it
    (a connection is refused). A socket of a live server, or a file that is not such a socket, is left alone."""
    import os

    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(KV_SOCKET_PREFIX)]
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(KV_SOCKET_PREFIX):].partition("-")[0]  # an old name without a process: not ours to judge
        path = os.path.join(folder, name)
        if pid_text.isdigit() and not _process_exists(int(pid_text)) and _refuses_connections(path):
            try:
                os.unlink(path)
            except OSError:
                continue
            removed.append(path)
    if removed:
        log.info("removed %d KV-event socket(s) of servers that were killed: %s", len(removed), ", ".join(removed))
    return removed


def _process_exists(pid: int) -> bool:
    """Whether a process with this id exists (another user's too)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's, or not a process id this system can name: keep what carries it
    return True


def _refuses_connections(path: str) -> bool:
    """Whether `path` is a Unix socket on which nothing listens (a connection is refused)."""
    import os
    import socket
    import stat

    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False  # something listens there


GRACEFUL_HTTP_S = 5  # once the engine has stopped, how long the HTTP server waits for open connections
EXIT_DEADLINE_S = 30.0  # after a SIGTERM, the most `spanq serve` takes to exit (plus any --shutdown-timeout)


async def _run_server(args: argparse.Namespace, guard: ExitGuard) -> None:
    """vLLM's `run_server`, less the SIGTERM handler it sets for the engine's startup, and with a bound on the
    HTTP server's graceful shutdown.

    A SIGTERM (also the one a supervisor's death sends, `spanq_backend.cluster.supervise`) ends the server and
    its engine core within a bound (`ExitGuard`): before the HTTP server is up, at once; after, through vLLM's
    graceful shutdown (the engine core is stopped, then the HTTP server, which leaves open connections
    `GRACEFUL_HTTP_S`), or killed `EXIT_DEADLINE_S` after the signal. (vLLM's handler for the startup raises
    KeyboardInterrupt, which its engine launch swallows: a server stopped while its engine core started would
    wait minutes for an engine core that waits for it, or go on serving.)"""
    from vllm.entrypoints.launchers.api_server import entry

    follow = asyncio.ensure_future(guard.follow_graceful())
    try:
        entry.decorate_logs("APIServer", skip_if_decorated=True)
        listen_address, sock = entry.setup_server(args, reuse_port=False)
        await entry.run_server_worker(listen_address, sock, args, timeout_graceful_shutdown=GRACEFUL_HTTP_S)
    finally:
        follow.cancel()


def serve_main(argv: list[str]) -> int:
    """`spanq serve ...`: run the server until interrupted."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    guard = ExitGuard(EXIT_DEADLINE_S)  # a SIGTERM from here on ends this process and its engine core
    guard.install()
    if on_cpu():
        # The model runner in the engine core's process, every core bound (unless set): how the embedded engine and
        # every served test run. vLLM's own CPU default runs it in a process of its own, with an index of a span
        # tier apart from the scheduler's (docs/design.md §10: a refused block was offered forever there).
        cpu_env_defaults()
    cli_env_setup()
    try:
        args = parse_serve_args(argv)
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

        validate_parsed_serve_args(args)
        from spanq_backend.serving.logs import level

        level()  # an unknown SPANQ_LOG_LEVEL is an error before anything starts
        tokenizer = load_chat_tokenizer(args.tokenizer or args.model)
    except (ValueError, SpanQueryError) as e:
        print(f"spanq serve: error: {e}", file=sys.stderr)
        return 2

    import uvloop
    from vllm.logger import configure_logging_from_args

    from spanq_backend.serving import logs

    if not hasattr(args, "log_level") and getattr(args, "logging_config", None) is None:
        args.log_level = logs.level(args.spanq_verbose)  # none given: spanq's (vLLM's warnings and errors only)
    configure_logging_from_args(args)  # (the engine core process inherits this configuration)

    logs.configure(verbose=args.spanq_verbose)
    from spanq_backend.serving.families import family_line

    log.info("%s", family_line(args.model))
    from spanq_backend.serving import metrics

    metrics.register()  # spanq's counters on /metrics from the first scrape
    from spanq_backend.vllm_integration.frontend import query_route_mounted

    limits = limits_of(args)
    anchor, redo = args.spanq_span_anchor, args.spanq_recompute
    lead_in = args.spanq_span_lead_in
    started = time.perf_counter()
    log.info("starting a span-aware vLLM server on %s …%s", args.model,
             " (eager, to start in seconds: --no-enforce-eager compiles the model as vLLM does by default, a minute"
             " more at start, ~30% faster decoding on a CPU)"
             if args.enforce_eager and on_cpu() else "")  # (docs/benchmarks.md, "`spanq serve`'s engine mode")

    def router() -> Any:  # vLLM builds the app once its engine is up: said as the embedded engine says it
        name = args.served_model_name[0] if args.served_model_name else args.model
        scheme = "https" if args.ssl_certfile else "http"
        where = f"unix socket {args.uds}" if args.uds else f"{scheme}://{args.host or '0.0.0.0'}:{args.port}"
        log.info("%s ready in %.1f s; the HTTP server starts on %s (POST /v1/query/execute, /v1/chat/completions)",
                 name, time.perf_counter() - started, where)  # fmt: skip
        return build_query_router(
            tokenizer, args.served_model_name, limits, anchor, redo, lead_in,
            args.spanq_cold_spans, args.spanq_isolate_min_tokens, args.spanq_read_in_context,
            args.spanq_keep_span_order,
        )

    with query_route_mounted(router):
        guard.deadline_s += args.shutdown_timeout  # vLLM's drain (--shutdown-timeout) comes first
        try:
            uvloop.run(_run_server(args, guard))
        except OSError as e:  # the address: in use, or not this machine's
            print(f"spanq serve: error: cannot listen on {args.host or '0.0.0.0'}:{args.port}: {e.strerror or e}",
                  file=sys.stderr)  # fmt: skip
            return 2
        finally:
            _remove_own_kv_socket(args)
    _exit_now(0)
    return 0  # (not reached)


def _exit_now(code: int) -> None:
    """End the process once the server and its engine have shut down, without the interpreter's finalization: the
    Triton bindings vLLM imports report ~500 "leaked" objects there (nanobind's check, ~30 lines after "Application
    shutdown complete" on every Ctrl-C). Logs and streams are flushed first."""
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _remove_own_kv_socket(args: argparse.Namespace) -> None:
    """The KV-event socket this server made (`kv_events_socket_path`) goes with it: vLLM leaves the file behind.
    (A server killed before this runs leaves it to the next server's sweep.)"""
    import os

    endpoint = getattr(args.kv_events_config, "endpoint", "") or ""
    path = endpoint.removeprefix("ipc://")
    if endpoint.startswith("ipc://") and os.path.basename(path).startswith(f"{KV_SOCKET_PREFIX}{os.getpid()}-"):
        try:
            os.unlink(path)
        except OSError:
            pass


if __name__ == "__main__":
    raise SystemExit(serve_main(sys.argv[1:]))
