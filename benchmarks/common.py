"""Plumbing shared by the benchmarks: options, engines side by side, deterministic documents, statistics, and the
report every benchmark writes (a table on stdout, `<out>/<stem>.json`, `<out>/<stem>.png`; `<out>` is the --out
folder every benchmark takes, `results/NAME/` under the current directory by default)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spanq_backend.serving.cluster_options import positive_int  # (an argparse type: at least 1)

__all__ = [
    "LABEL_ENV",
    "WORDS",
    "BenchReport",
    "base_parser",
    "close_backend",
    "default_out",
    "engine_pair",
    "environment",
    "float_list",
    "format_table",
    "int_list",
    "make_backend",
    "make_documents",
    "model_label",
    "new_figure",
    "only_with",
    "percentile",
    "progress",
    "reset_cache",
    "summarize",
    "ttft_of",
    "warm_up",
]

LABEL_ENV = "SPANQ_BENCH_LABEL"
"""An environment variable: if set, its value is recorded in every report's environment as `label` (which
checkout, branch or build the numbers come from: reports record the spanq version, not a commit)."""

# A fixed vocabulary: documents are sentences of these words, drawn by a seeded generator, so every run of a
# benchmark reads the same text and every document differs from every other.
WORDS = (
    "river", "mountain", "garden", "window", "harbor", "lantern", "meadow", "village", "castle", "forest",
    "bridge", "market", "orchard", "valley", "island", "temple", "candle", "mirror", "ladder", "basket",
    "blanket", "kettle", "hammer", "needle", "pocket", "saddle", "shovel", "tunnel", "violin", "whistle",
    "anchor", "barrel", "button", "carpet", "cellar", "chimney", "compass", "copper", "feather", "fence",
    "fountain", "glacier", "granite", "helmet", "jacket", "kitchen", "library", "marble", "meadowlark",
    "monastery", "oyster", "pepper", "pillow", "quarry", "rabbit", "saffron", "sailor", "scarlet", "shadow",
    "silver", "sparrow", "spruce", "statue", "summit", "thimble", "thunder", "timber", "tower", "trumpet",
    "velvet", "walnut", "wizard", "yellow", "amber", "ancient", "bitter", "brave", "bright", "broken",
    "calm", "careful", "cheerful", "clever", "cold", "crooked", "curious", "dusty", "eager", "early",
    "famous", "fierce", "gentle", "golden", "graceful", "hidden", "hollow", "humble", "icy", "kind", "lazy",
    "lively", "lonely", "loud", "lucky", "narrow", "noble", "old", "patient", "plain", "polite", "proud",
    "quiet", "rapid", "rare", "rough", "round", "rusty", "shiny", "silent", "simple", "slow", "smooth",
    "soft", "sour", "steady", "strange", "sturdy", "sudden", "sweet", "tall", "tender", "tidy", "tiny",
    "warm", "weary", "wild", "wise", "wooden", "young", "carries", "builds", "finds", "paints", "follows",
    "guards", "hides", "lifts", "mends", "opens", "pulls", "reads", "repairs", "sells", "sings", "sweeps",
    "throws", "visits", "watches", "writes", "counts", "gathers", "weighs", "measures", "polishes",
    "trades", "borrows", "remembers", "forgets", "describes", "admires", "ignores", "collects", "delivers",
    "near", "behind", "beside", "under", "above", "across", "beyond", "inside", "toward", "around",
    "before", "after", "during", "morning", "evening", "winter", "summer", "autumn", "spring", "midnight",
    "harvest", "festival", "journey", "secret", "promise", "letter", "story", "song", "riddle", "recipe",
    "map", "ledger", "treaty", "voyage", "rumor", "legend", "portrait", "melody",
)


# --------------------------------------------------------------------------------------------- options


def positive_int_list(text: str) -> list[int]:
    """`"1,2,4"` → `[1, 2, 4]`, each at least 1 (an argparse type: counts and sizes, where 0 means nothing)."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers of at least 1, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """`"1,2,4"` → `[1, 2, 4]` (an argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """`"0,0.5"` → `[0.0, 0.5]` (an argparse type)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def names_from(choices: Sequence[str], what: str) -> Any:
    """An argparse type: a comma-separated list of `choices` (each once, in the order given)."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


def temperature_list(text: str) -> list[float]:
    """`"0,0.5"` → `[0.0, 0.5]`, each a sampling temperature (0 to 2; an argparse type: refused before any engine
    starts, where a call's own check came after both had)."""
    from spanq_integrations.query.ir import MAX_TEMPERATURE

    values = float_list(text)
    if not values or not all(0 <= v <= MAX_TEMPERATURE for v in values):
        raise argparse.ArgumentTypeError(f"expected temperatures from 0 to {MAX_TEMPERATURE:g}, got {text!r}")
    return values


def default_out(name: str) -> Path:
    """Where benchmark `name` writes without --out: `results/NAME/`, relative to the current working directory."""
    return Path("results") / name


def base_parser(
    name: str,
    description: str,
    *,
    model: str | None = "tiny",
    model_help: str | None = None,
    reps: int | None = 3,
) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes: --model, --reps, --seed, --out, --tag,
    --no-progress. `description`: the benchmark's docstring, of which `--help` shows the first paragraph (its first
    line cut sentences off). `reps=None` leaves out --reps (for a benchmark that counts its repetitions its own
    way); `model_help` replaces the help of --model."""
    parser = argparse.ArgumentParser(prog=f"spanq bench {name}", description=" ".join(description.split("\n\n")[0].split()))
    parser.add_argument(
        "--model",
        default=model,
        help=model_help or f"tiny, default (SmolLM2-135M-Instruct) or a model folder (default: {model})",
    )
    if reps is not None:
        parser.add_argument("--reps", type=positive_int, default=reps, help=f"repetitions per setting (default: {reps})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated documents and orders")
    parser.add_argument(
        "--out", type=Path, default=default_out(name), metavar="DIR",
        help=f"folder the JSON (and the plot, where the benchmark draws one) is written to (default: "
        f"{default_out(name)}, under the current directory)",
    )
    parser.add_argument("--tag", default="", help="suffix of the output file names, to keep several runs")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's INFO log lines too")
    parser.add_argument("--no-progress", action=_NoProgress, help="no progress bar (the model loader's neither)")
    return parser


class _NoProgress(argparse.Action):
    """--no-progress: the benchmark's bar off, and the bars of what loads models with it (transformers' "Loading
    weights", which showed on every engine start of a run that asked for none)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, True)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # (read by the hub's bars, and by processes started later)
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            return
        hf_logging.disable_progress_bar()


def only_with(parser: argparse.ArgumentParser, args: argparse.Namespace, needed: str, on: bool,
              defaults: dict[str, Any]) -> None:
    """Options that mean something only with the flag `needed` (each declared with default None, its real default
    in `defaults`): refused by name where `needed` is off (ignored, they let a long default run start), else given
    their defaults where not given."""
    given = ["--" + dest.replace("_", "-") for dest in defaults if getattr(args, dest) is not None]
    if given and not on:
        parser.error(f"{', '.join(given)} only apply with {needed}: without it they would be ignored")
    for dest, default in defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def add_recompute_flag(parser: argparse.ArgumentParser) -> None:
    """`--recompute SETTING`: the span engine's recompute setting for calls that say nothing (EngineConfig.recompute);
    without it, the engine's default."""
    from spanq_backend.serving.recompute import recompute_arg

    parser.add_argument(
        "--recompute", type=recompute_arg, default=None, metavar="SETTING",
        help="span blocks recomputed in context (first+question, question, 0, first, last, attention or a share; "
        "default: the engine's, first+question; tables measured before 2026-12-06 ran at question, before "
        "2026-12-04 at 0)",
    )  # fmt: skip


def engine_options_of(args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    """`EngineConfig` fields for a benchmark's engines: `options`, and the --recompute asked for, if any."""
    if getattr(args, "recompute", None) is not None:
        options["recompute"] = args.recompute
    return options


def model_label(model: str) -> str:
    """A short name for file names and tables: tiny, smollm2, or the model folder's name."""
    if model in ("default", "smollm2"):
        return "smollm2"
    if model == "tiny":
        return "tiny"
    return Path(model).name or "model"


# --------------------------------------------------------------------------------------------- engines


def make_backend(model: str, *, spans: bool, kv_blocks: int | None = None, **engine_options: Any) -> Any:
    """An `EmbeddedBackend` on `model`: span-aware, or (spans=False) stock vLLM with prefix caching.

    `kv_blocks` caps the KV cache at that many blocks, for workloads whose point is eviction;
    `engine_options` are `EngineConfig` fields. Close it with `close_backend`.
    """
    from spanq_backend.serving.embedded import EmbeddedBackend

    return EmbeddedBackend(model, spans=spans, num_blocks=kv_blocks, **engine_options)


def close_backend(backend: Any) -> None:
    """Stop the engine of a backend made by `make_backend` or `engine_pair`."""
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.close()
    else:
        backend.close()


def paired_speedup(slow: dict[int, float], fast: dict[int, float]) -> float:
    """The median over repetitions of slow / fast, each repetition's two runs measured back to back."""
    return summarize([slow[k] / fast[k] for k in fast if k in slow and fast[k] > 0])["median"]


def settle(backend: Any) -> None:
    """Wait until the span engine has nothing left to do in the background (`SpanEngine.settle`: deferred prepares,
    documents read in context when idle): done before every measurement, the baseline's too, since on a shared CPU
    that work would slow it, and before a cache reset, which work queued before it would otherwise outlive."""
    engine = getattr(backend, "engine", None)
    if engine is not None and hasattr(engine, "settle"):
        engine.settle()


def reset_cache(backend: Any) -> None:
    """Empty the prefix cache of a backend made by `make_backend` or `engine_pair`, so the next measurement starts
    cold (spans anchored on the chat template are reused across system prompts, so a new system prompt is not
    enough)."""
    from spanq_integrations.runtime.sync import run_sync

    engine = getattr(backend, "engine", None)
    done = engine.reset_prefix_cache() if engine is not None else run_sync(backend.areset_prefix_cache)
    if not done:
        raise RuntimeError("the engine could not reset its prefix cache (requests still running)")


def ready(backend: Any) -> None:
    """One plain 1-token request to `backend`, right before a measurement of it: each measurement then starts from
    the same state of its engine's process, one that has just served a request. Without it a measurement taken right
    after another of the same process ran 10–15% faster than one taken after the other process's (SmolLM2, warm
    queries of 100–250 ms here, 2026-12-07): the rag benchmark's fixed order measured stock cold after stock's own
    last query and spans cold after stock's, and swapping the order of a pair moved its ratio by that much."""
    from spanq_integrations import execute, generate, user

    execute(generate(user("Ready?"), max_tokens=1, temperature=0.0), backend)


def warm_up(backend: Any) -> None:
    """One small span query, so first-call costs (graph capture, allocator) stay out of the measurements."""
    from spanq_integrations import cross, execute, fragment, generate, plus, system, user

    docs = [fragment(f"Warm-up note {i}: " + " ".join(WORDS[i * 7 : i * 7 + 40])) for i in range(3)]
    for order in (docs, docs[::-1]):
        execute(generate(cross(system("Warm up."), plus(*order), user("Ready?")), max_tokens=2, temperature=0.0), backend)
    generator = getattr(getattr(backend, "engine", None), "generator", None)
    if generator is not None:
        generator.corpus_lead_in = None  # the lead-in comes from the benchmark's own documents, not these


@contextmanager
def engine_pair(
    model: str, *, backends: tuple[Any, Any] | None = None, kv_blocks: int | None = None, **engine_options: Any
) -> Iterator[tuple[Any, Any]]:
    """`(stock, spans)`: the baseline and the span-aware engine on `model`, warmed up, closed on exit.

    The baseline is stock vLLM in a process of its own with the plugin off (`ProcessBackend`); the span-aware
    engine runs in this process. Both have prefix caching on and the same engine options; each measures its
    calls' times where its engine runs. `backends` given: use those (owned by the caller, not closed), e.g. one
    pair shared by several runs.
    """
    if backends is not None:
        yield backends
        return
    stock, spans = start_pair(model, kv_blocks=kv_blocks, **engine_options)
    try:
        yield stock, spans
    finally:
        close_backend(spans)
        close_backend(stock)


def start_pair(model: str, *, kv_blocks: int | None = None, **engine_options: Any) -> tuple[Any, Any]:
    """`(stock, spans)` as `engine_pair` makes them, started and warmed up side by side: the stock process starts
    (and is warmed up, from a thread of this one that mostly waits on it) while the span engine starts here. The
    caller closes both (`close_backend`); on a failure neither is left running."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.process_backend import ProcessBackend

    def stock_engine() -> Any:
        stock = ProcessBackend(model, spans=False, plugin=False, num_blocks=kv_blocks, **engine_options)
        try:
            warm_up(stock)
        except BaseException:
            close_backend(stock)
            raise
        return stock

    with ThreadPoolExecutor(1, thread_name_prefix="spanq-bench-stock") as pool:
        pending = pool.submit(stock_engine)
        spans = None
        try:
            spans = make_backend(model, spans=True, kv_blocks=kv_blocks, **engine_options)
            warm_up(spans)
            return pending.result(), spans
        except BaseException:
            if spans is not None:
                close_backend(spans)
            if not pending.cancel() and pending.exception() is None:
                close_backend(pending.result())
            raise


def ttft_of(call: Any) -> float:
    """A call's time to first token; its wall time when no text came out (a 1-token answer that decodes to "")."""
    return call.ttft_s if call.ttft_s is not None else call.wall_s


# --------------------------------------------------------------------------------------------- documents


def make_documents(tokenizer: Any, count: int, tokens: int, *, seed: int, start: int = 0, title: str = "Document") -> list[str]:
    """`count` different documents of about `tokens` tokens each (never more), the same for the same arguments.

    Document i is `"{title} {start+i}."` followed by sentences of `WORDS` drawn by a generator seeded with
    `(seed, start+i)`; sentences are added while the text stays within `tokens` tokens.
    """
    docs = []
    for i in range(start, start + count):
        rng = random.Random(f"spanq-doc:{seed}:{i}")
        text = f"{title} {i}."
        while True:
            n = rng.randint(6, 14)
            words = [rng.choice(WORDS) for _ in range(n)]
            sentence = " " + " ".join(words).capitalize() + "."
            if len(tokenizer.encode(text + sentence, add_special_tokens=False)) > tokens:
                break
            text += sentence
        docs.append(text)
    return docs


# --------------------------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between order statistics; nan for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return math.nan
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, mean, median, p90, p99, min and max of `values`."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": math.nan, "median": math.nan, "p90": math.nan, "p99": math.nan, "min": math.nan, "max": math.nan}
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "median": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "min": min(xs),
        "max": max(xs),
    }


# --------------------------------------------------------------------------------------------- output


def faster(ratio: float | None, digits: int = 2) -> str:
    """A time ratio (the baseline's time over the measured one) in words: "2.20x faster", and below 1 "2.20x slower"
    (it read "0.45x faster")."""
    if ratio is None or not ratio > 0 or ratio == float("inf"):
        return "n/a"
    return f"{ratio:.{digits}f}x faster" if ratio >= 1 else f"{1 / ratio:.{digits}f}x slower"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1) -> str:
    """A plain-text table: the first `left` columns left-aligned, the others right-aligned; floats to 3 significant
    digits, NaN as "-", strings as they are."""

    def cell(x: Any) -> str:
        if isinstance(x, float):
            if math.isnan(x):
                return "-"
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    text_rows = [[cell(x) for x in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in text_rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line([str(h) for h in headers]), rule, *(line(r) for r in text_rows)])


def progress(total: int, desc: str, *, disable: bool = False) -> Any:
    """A tqdm progress bar on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True, leave=False)


def code_origin() -> str:
    """Which spanq ran: the folder its packages were imported from (no commit: reports name none, `LABEL_ENV`
    does). A run of older code from a worktree shows here: `PYTHONPATH=../wt python -m spanq_integrations.cli ...`
    started in the repository's own folder imports the repository's code, not the worktree's (the current folder
    comes first on `sys.path`); start it in the worktree."""
    import spanq_backend

    return str(Path(spanq_backend.__file__).resolve().parents[1])


def environment() -> dict[str, Any]:
    """Where the numbers were measured: machine, load, spanq and library versions, command line, and the label
    in $SPANQ_BENCH_LABEL if set."""
    from spanq_integrations import __version__ as spanq_version

    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["spanq", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "spanq": spanq_version,
    }
    info["code"] = code_origin()
    label = os.environ.get(LABEL_ENV)
    if label:
        info["label"] = label
    for module in ("torch", "vllm", "transformers"):
        mod = sys.modules.get(module)
        if mod is not None:
            info[module] = getattr(mod, "__version__", None)
    return info


@dataclass
class BenchReport:
    """What one benchmark run writes into `args.out` (the --out folder of `base_parser`): `<stem>.json` (config,
    environment, rows, summary) and the plot `<stem>.png`.

    The stem is `NAME-LABEL[-TAG]`: LABEL is `label`, by default the model's (`model_label`); `label=""` leaves
    it out (`NAME[-TAG]`).
    """

    name: str
    args: argparse.Namespace
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: Any = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    label: str | None = None
    written: list[Path] = field(default_factory=list)
    """The files `write` wrote."""

    def __post_init__(self) -> None:
        """The --out folder is made and checked before anything is measured (a folder that cannot be written
        failed the run at its end, minutes of measurement lost): a usage error naming it, exit status 2."""
        probe = self.out_dir / f".write-check-{os.getpid()}"
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            print(f"spanq bench {self.name}: error: --out {self.out_dir} cannot be written: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    @property
    def out_dir(self) -> Path:
        return Path(self.args.out)

    @property
    def stem(self) -> str:
        label = model_label(getattr(self.args, "model", "") or "model") if self.label is None else self.label
        tag = getattr(self.args, "tag", "")
        return "-".join(part for part in (self.name, label, tag) if part)

    @property
    def json_path(self) -> Path:
        return self.out_dir / f"{self.stem}.json"

    @property
    def plot_path(self) -> Path:
        return self.out_dir / f"{self.stem}.png"

    def write(self, figure: Any = None) -> Path:
        """Write the JSON (and the figure, if given); returns the JSON's path."""
        self.written = []
        self.out_dir.mkdir(parents=True, exist_ok=True)
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(self.args).items()}
        payload = {
            "benchmark": self.name,
            "config": {**args, **self.config},
            "environment": {**environment(), "bench_seconds": time.perf_counter() - self.started},
            "rows": self.rows,
            "summary": self.summary,
        }
        self.json_path.write_text(json.dumps(_finite(payload), indent=2, default=str, allow_nan=False) + "\n")
        self.written.append(self.json_path)
        if figure is not None:
            figure.savefig(self.plot_path, dpi=110, bbox_inches="tight")
            import matplotlib.pyplot as plt

            plt.close(figure)
            self.written.append(self.plot_path)
        return self.json_path

    def print_files(self) -> None:
        """Print the paths of the files `write` wrote."""
        if self.written:
            print("\nwrote " + " and ".join(str(p) for p in self.written) + f" (spanq from {code_origin()})")


def _finite(x: Any) -> Any:
    """`x` with NaN and infinities as null (strict JSON) and tensors/arrays as lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if hasattr(x, "tolist"):
        return _finite(x.tolist())
    return x


def new_figure(ncols: int = 1, *, nrows: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Any, Any]:
    """A matplotlib figure (headless backend) with `nrows` x `ncols` axes of `width` x `height` inches each, and
    the list of its axes, row by row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, list(axes.flat)
