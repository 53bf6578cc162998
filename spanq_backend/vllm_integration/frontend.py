"""The patches that run in the front-end process (the one that drives an engine or serves HTTP). Unlike the
engine core's and the workers', they are not installed at registration: each holds only while it is needed
(`Patch.scoped`). Both are in the package's registry, `spanq_backend.vllm_integration.PATCHES`.

- `in_process_engines`: vLLM's engine core shutdown tears down the process's distributed state, which every
  other in-process engine still uses; while others are alive, `cleanup_dist_env_and_memory` is replaced by a
  plain garbage collection for the duration of one shutdown. Removable once vLLM scopes that state per engine.
- `query_route_mounted`: vLLM's `build_app`, for the duration of `spanq serve`, also mounts the query route.
  Removable if vLLM's server gains a way to add routes from a plugin.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from spanq_backend.vllm_integration.patching import Patch

__all__ = ["FRONTEND_PATCHES", "InProcessEngines", "in_process_engines", "query_route_mounted"]

log = logging.getLogger("spanq.vllm")

SPARE_DIST_STATE = Patch(
    "front end", "vllm.v1.engine.core", "cleanup_dist_env_and_memory",
    "while other in-process engines live, one engine's shutdown must not tear down the process's distributed "
    "state they use: a plain garbage collection instead, for that shutdown only", scoped=True)
MOUNT_QUERY_ROUTE = Patch(
    "front end", "vllm.entrypoints.launchers.api_server.entry", "build_app",
    "`spanq serve` adds its query route to the app vLLM's server builds (build_and_serve looks it up when it "
    "runs), for the duration of the command", scoped=True)
FRONTEND_PATCHES: tuple[Patch, ...] = (SPARE_DIST_STATE, MOUNT_QUERY_ROUTE)


def _collect_garbage_instead(stock: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: gc.collect()


class InProcessEngines:
    """The vLLM engines whose engine core runs in this process: started and retired through here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = 0
        self._tiers = 0  # live engines with a span tier (a KV connector: vLLM keeps one per process)

    def starting(self, tier: bool = False) -> None:
        """Count an engine in; refused (RuntimeError) where it and another would share vLLM's one KV connector of
        the process: an engine with a span tier is the only in-process engine while it lives."""
        with self._lock:
            if tier and self._live:
                raise RuntimeError(
                    f"an engine with a span tier must be the only vLLM engine in its process ({self._live} other "
                    "running here: vLLM keeps one KV connector per process); close the others first, or serve the "
                    "tier engine from its own process (spanq serve --tier-dir)"
                )
            if self._tiers:
                raise RuntimeError(
                    "an engine with a span tier is running in this process and must be the only one (vLLM keeps one "
                    "KV connector per process): close it first, or start this engine in another process"
                )
            self._live += 1
            self._tiers += int(tier)

    def failed_to_start(self, tier: bool = False) -> None:
        with self._lock:
            self._live -= 1
            self._tiers -= int(tier)

    def retire(self, engine: Any, tier: bool = False) -> None:
        """Shut an `LLMEngine` down now (not at garbage collection), sparing the process's distributed state
        unless it is the last in-process engine."""
        with self._lock:
            self._live -= 1
            self._tiers -= int(tier)
            spared = SPARE_DIST_STATE.applied(_collect_garbage_instead) if self._live > 0 else contextlib.nullcontext()
            with spared:
                try:
                    engine.engine_core.shutdown()
                except Exception:  # a failed engine may not shut down cleanly; it is gone either way
                    log.exception("shutting the engine down failed")


in_process_engines = InProcessEngines()


@contextlib.contextmanager
def query_route_mounted(router: Callable[[], Any]) -> Iterator[None]:
    """While inside, vLLM's `build_app` also includes `router()` (a FastAPI router) in the app it builds, and runs
    its `spanq_before_metrics(app)`, if it has one, before each GET /metrics (vLLM's own route) answers, and its
    `spanq_engine_request(app, started)` around each request of vLLM's other POST routes (the engine's work that
    is not spanq's: a stock chat completion)."""

    def including_the_route(stock_build_app: Callable[..., Any]) -> Callable[..., Any]:
        def build_app(args: Any, supported_tasks: Any = None, model_config: Any = None) -> Any:
            app = stock_build_app(args, supported_tasks, model_config)
            included = router()
            own = {getattr(route, "path", None) for route in included.routes}
            app.include_router(included)
            hook = getattr(included, "spanq_before_metrics", None)
            counted = getattr(included, "spanq_engine_request", None)
            # (the app has started: no middleware can be added to it any more; its routes' apps are wrapped)
            for route in app.router.routes:
                path = getattr(route, "path", None)
                if hook is not None and path == "/metrics":  # vLLM's route and its mount
                    route.app = _BeforeMetrics(route.app, hook)
                elif counted is not None and "POST" in (getattr(route, "methods", None) or ()) and path not in own \
                        and path not in _NOT_ENGINE_WORK:
                    route.app = _Counted(route.app, counted)
            return app

        return build_app

    with MOUNT_QUERY_ROUTE.applied(including_the_route):
        yield


_NOT_ENGINE_WORK = frozenset({"/tokenize", "/detokenize"})  # POST routes that run nothing in the engine


class _Counted:
    """A route's ASGI app, with `hook(app, True)` before a request and `hook(app, False)` once its answer (a stream
    too) is sent or the client went away."""

    def __init__(self, app: Any, hook: Callable[[Any, bool], None]):
        self.app, self.hook = app, hook

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.hook(scope["app"], True)
        try:
            await self.app(scope, receive, send)
        finally:
            self.hook(scope["app"], False)


class _BeforeMetrics:
    """A /metrics route's ASGI app, with `hook(app)` awaited before it answers."""

    def __init__(self, app: Any, hook: Callable[[Any], Any]):
        self.app, self.hook = app, hook

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self.hook(scope["app"])
        await self.app(scope, receive, send)
