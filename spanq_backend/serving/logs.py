"""Quiet by default: spanq's own progress lines, and vLLM's warnings and errors only.

An embedded engine (the demo, notebooks, `ChatSpanQuery()`), `spanq serve`, `spanq run` and `spanq bench` call
`configure()` before vLLM builds an engine. What it does:

- vLLM's loggers (`vllm.*`) log at WARNING, so its INFO lines (the engine config dump, throughput every ten
  seconds, compilation notes) stay out of the way. `SPANQ_LOG_LEVEL=INFO` (or `DEBUG`), or `--verbose` on the
  command line, brings them back; a `VLLM_LOGGING_LEVEL` you set yourself is kept when `SPANQ_LOG_LEVEL` is not
  set. Engine processes started later (`spanq serve`'s engine core) read the same level from the environment.
- A few warnings that vLLM prints about how spanq drives it, which a user cannot act on, are dropped at the
  default level (`SPANQ_NOISE`, each with the reason); every other warning and every error is shown.
- spanq's own progress (`spanq: starting…`, `spanq: ready in 9.8 s`, `spanq: prepared 8 spans…`) goes to stderr
  through the `spanq` logger, at INFO, unless you configured that logger yourself.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["LOG_LEVEL_ENV", "SPANQ_NOISE", "configure", "level", "quiet_import"]

LOG_LEVEL_ENV = "SPANQ_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

SPANQ_NOISE: dict[str, str] = {
    "is already registered. Overwriting": "a second engine in one process registers vLLM's kernels again",
    "is not found in LD_PRELOAD": "an allocator hint for vLLM's CPU backend, not a fault",
    "doesn't allow to use `torch.set_num_threads` after the thread binding": "spanq binds the threads itself",
    "Passing raw prompts to InputProcessor is deprecated": "spanq passes token ids it laid out itself",
    "Unknown vLLM environment variable detected: VLLM_DIST_IDENT": "set by vLLM's own CPU launcher",
    "The global random seed is set to": "spanq seeds its engines on purpose (reproducible benchmarks)",
    "Enforce eager set": "spanq runs eager on CPU on purpose (no compile step at start-up)",
    "Inductor compilation was disabled by user settings": "the same choice, said again",
    "triton-cpu is expected on x86 CPUs": "a platform fact of the CPU build; spanq needs no Triton there",
    "Triton is installed, but doesn't include CPU backend": "the same platform fact, said when vLLM is imported",
    "Model Runner V2 requires Triton": "the same platform fact",
    "Initializing KVConnectorBase_V1. This API is experimental": "spanq's span tier is a KV connector on purpose",
    "selects a KV connector that does not support it": "spanq runs one KV cache group anyway (hybrid manager off)",
    "Reset SSM cache type to float32": "no SSM layers in the models spanq starts; a platform default said aloud",
}
"""Warnings dropped at the default level: a part of the message, and why it is noise here."""

_NOISY_LOGGERS = (
    "vllm.triton_utils.dispatcher",
    "vllm.triton_utils.importing",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.engine.input_processor",
    "vllm.platforms.interface",
    "vllm.platforms.cpu",
    "vllm.engine.arg_utils",
    "vllm.config.vllm",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
)
"""The loggers those warnings come from. The filter sits on them, not on vLLM's handler, because vLLM rebuilds
its handlers (`logging.config.dictConfig`) whenever an engine applies its logging config."""

_PYTHON_NOISE = (r".*torch\.distributed\.reduce_op.*", r".*torch\.jit\.script_method.*")


def level(verbose: bool = False) -> str:
    """The level vLLM logs at: INFO with `verbose`, else `SPANQ_LOG_LEVEL`, else your `VLLM_LOGGING_LEVEL`, else
    WARNING. An unknown `SPANQ_LOG_LEVEL` is a clear error naming the accepted ones."""
    if verbose:
        return "INFO"
    chosen = os.environ.get(LOG_LEVEL_ENV)
    if chosen is None:
        return os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper()
    if chosen.upper() not in LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV}={chosen!r} is not a log level: use one of {', '.join(LEVELS)}")
    return chosen.upper()


def shows_progress() -> bool:
    """Whether vLLM's progress bars (loading the weights) are shown: at INFO or DEBUG, not on a quiet run, where
    a bar is several lines of a captured log, more the slower the disk."""
    return level(_verbose) in ("DEBUG", "INFO")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        return not any(part in message for part in SPANQ_NOISE)


_NOISE_FILTER = _DropNoise()


_verbose = False


def quiet_import() -> None:
    """Drop the noise vLLM logs while it is imported (before `configure` runs: at spanq's first import of vLLM,
    with no handler of vLLM's yet, the line was printed bare, the first a new user saw), unless a level that shows
    vLLM's INFO lines is asked for. An unknown `SPANQ_LOG_LEVEL` is left for `configure` to name."""
    try:
        quiet = logging.getLevelName(level()) >= logging.WARNING
    except ValueError:
        quiet = True
    if quiet:
        logging.getLogger("vllm.triton_utils.importing").addFilter(_NOISE_FILTER)


def configure(verbose: bool = False) -> str:
    """Set vLLM's log level (see the module docstring) and give spanq's progress a place on stderr; returns the
    level. Safe to call more than once: once asked to be verbose (`--verbose`), it stays verbose."""
    global _verbose
    _verbose = _verbose or verbose
    chosen = level(_verbose)
    os.environ["VLLM_LOGGING_LEVEL"] = chosen  # engine processes started from here on
    import vllm.logger  # noqa: F401  (configures the "vllm" logger and its handler, once)

    logging.getLogger("vllm").setLevel(chosen)
    quiet = logging.getLevelName(chosen) >= logging.WARNING
    for name in _NOISY_LOGGERS:
        noisy = logging.getLogger(name)  # the same object the module gets when it is imported later
        if quiet:
            noisy.addFilter(_NOISE_FILTER)
        else:
            noisy.removeFilter(_NOISE_FILTER)
    if quiet:
        for pattern in _PYTHON_NOISE:
            warnings.filterwarnings("ignore", message=pattern)

    spanq_logger = logging.getLogger("spanq")
    if not spanq_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("spanq: %(message)s"))
        spanq_logger.addHandler(handler)
        spanq_logger.propagate = False  # one line each, whether or not the root logger has a handler
        spanq_logger.setLevel(logging.INFO)
    return chosen
