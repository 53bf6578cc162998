"""`python -m benchmarks NAME [options]` from a source checkout: the same as `spanq bench NAME [options]`."""

from __future__ import annotations

import sys

from benchmarks import bench_main

if __name__ == "__main__":
    raise SystemExit(bench_main(sys.argv[1:]))
