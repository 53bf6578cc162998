"""`spanq serve`'s cluster options, defined once: the single-engine command shows them in its help and refuses
them without `--replicas`; the cluster (`spanq_backend.cluster.app`) parses them. Apart from `server.py`, which
imports vLLM: `spanq serve --replicas` with a bad option is refused in a couple of seconds (Ray Serve's and
FastAPI's imports), not after vLLM's (~12 s)."""

from __future__ import annotations

import argparse
import math

__all__ = ["CLUSTER_ONLY", "ROUTINGS", "TIER_COST", "add_cluster_arguments", "non_negative_int", "positive_float",
           "positive_int"]

# What loading a span from a span tier costs the affinity router, against computing it (a miss: 1; a span the
# replica's KV cache holds: 0; `spanq_backend/cluster/policy.py`). Measured on this project's CPU machine at 8 x 512
# on SmolLM2 (docs/benchmarks.md `tier`): a restart's load took 0.05-0.14 s of the step, where computing the same
# prompt took 9 s: 0.006-0.015. The default leaves room for a slower disk. `spanq serve --tier-cost C`.
TIER_COST = 0.1


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


ROUTINGS = ("affinity", "default")  # --routing: span affinity (spanq's router) or Ray Serve's own


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # (argparse names this function: "invalid non_negative_int value")
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_cluster_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`spanq serve`'s cluster options (with `--replicas`, the cluster extra serves N engines on Ray Serve:
    `spanq_backend.cluster`). Defined once: the single-engine command shows them in its help and refuses them
    without `--replicas`; the cluster parses them."""
    group = parser.add_argument_group(
        "cluster",
        "several replicas: with --replicas N, N span engines serve behind one address on Ray Serve, each query "
        "routed to the replica that holds most of its spans (the cluster extra: pip install 'spanq[cluster]')",
    )
    group.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                       help="serve N span engines behind one address (default: one engine, no Ray)")
    group.add_argument("--routing", choices=ROUTINGS, default="affinity",
                       help="with --replicas: route by span affinity (default) or with Ray Serve's own router")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="with --replicas: an existing Ray cluster (ray://host:10001, host:port or auto); "
                       "default: a local Ray on this machine")
    group.add_argument("--max-imbalance", type=non_negative_int, default=4, metavar="N",
                       help="with --replicas: a replica holding a query's spans is preferred unless its queue is more "
                       "than N requests longer than the shortest (default 4)")
    group.add_argument("--tier-cost", type=_fraction, default=TIER_COST, metavar="C",
                       help="with --replicas and --tier-dir: what loading a span from the span tier costs against "
                       "computing it (0 to 1): a replica holding a query's spans in its cache is preferred over a "
                       "less busy one that would load them only while its queue is at most C x --max-imbalance "
                       f"longer (default {TIER_COST}; measured 0.006-0.015 on a CPU)")
    group.add_argument("--queue-timeout", type=positive_float, default=60.0, metavar="S",
                       help="with --replicas: a request no replica has taken within S seconds (none running — all "
                       "restarting, say — or all at their limit of requests) is answered 503 (default 60)")
    return parser


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}") from None
    if not 0 <= value <= 1:  # (nan fails this too)
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a size, a time): 0, negatives, inf and nan are refused as the option's error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


CLUSTER_ONLY = ("--routing", "--ray-address", "--max-imbalance", "--tier-cost", "--queue-timeout")
