"""The benchmarks behind `spanq bench NAME` (or `python -m benchmarks NAME` in a source checkout): each is a module
here with `main(argv) -> int` that prints a table and writes JSON and a plot into its `--out DIR` (default
`results/NAME/` under the current directory; see docs/benchmarks.md), through the shared plumbing in
`benchmarks.common`. Register a new one in `BENCHMARKS`; modules are imported only when their benchmark runs."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["BENCHMARKS", "bench_main"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "rag": ("benchmarks.rag", "RAG time to first token vs number of documents: stock, spans cold, warm"),
    "nested": ("benchmarks.nested", "a judge over N inner generations: outer TTFT, spans vs stock"),
    "bulk": ("benchmarks.bulk", "a batch with shared fragments: bulk size, locality order, hit rate"),
    "quality": ("benchmarks.quality", "span vs full attention: exact match, KL divergence, padding"),
    "rerope": ("benchmarks.rerope", "repositioning throughput vs a plain copy; CIDRA planning cost"),
    "haystack": ("benchmarks.haystack", "needle in a haystack: flat judge vs tree reduction"),
    "cluster": ("benchmarks.cluster", "span-affinity vs Ray Serve's default routing over replicas: hit rate, TTFT"),
    "tier": ("benchmarks.tier", "the first query after an engine restart over a corpus compiled into a span tier"),
    "overhead": ("benchmarks.overhead", "requests without spans, plugin on vs off (own processes); client-side cost"),
}
"""name -> (module with `main(argv) -> int`, one-line description)."""


def _usage() -> str:
    lines = ["usage: spanq bench NAME [options]   (spanq bench NAME --help for its options)", "", "benchmarks:"]
    lines += [f"  {name:<10} {description}" for name, (_, description) in BENCHMARKS.items()]
    return "\n".join(lines)


def bench_main(argv: Sequence[str]) -> int:
    """`spanq bench NAME ...`: run benchmark NAME with the remaining arguments."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage(), file=sys.stdout if args else sys.stderr)  # (a usage error's text goes where errors go)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"spanq bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    # vLLM's INFO lines stay out of the tables unless --verbose or SPANQ_LOG_LEVEL asks for them.
    from spanq_backend.serving import logs

    try:
        logs.configure(verbose="--verbose" in rest)
    except ValueError as e:
        print(f"spanq bench: {e}", file=sys.stderr)
        return 2
    if "--verbose" not in rest and not os.environ.get("SPANQ_LOG_LEVEL"):
        # Each call's line of progress ("read 2 new documents in context ...") is for an app's user: a benchmark
        # runs hundreds of calls, and has its progress bar (they were hundreds of lines through it).
        logging.getLogger("spanq.generator").setLevel(logging.WARNING)
    module_name = BENCHMARKS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            print(f"spanq bench: {name} is not available in this installation ({module_name} is missing)",
                  file=sys.stderr)
            return 2
        raise
    return int(module.main(rest) or 0)
