"""What reading span blocks into an engine's KV cache can cost at best on this machine, without an engine: the
ceiling under `spanq bench tier`'s "load in the step" (docs/benchmarks.md, "tier").

    python scripts/tier_read_ceiling.py --blocks 131 --block-mb 1.47 --layers 30 --reps 3

Writes `--blocks` block files of `--block-mb` MB (random bytes, in the page cache after the first pass) and reads
them, each pass side by side in one process:

- plain read: each file into one reused buffer (what `spanq bench tier` calls a plain read reads the files with
  `Path.read_bytes`, into fresh memory; both are printed);
- into the cache: each file's `--layers` parts with one `preadv` straight into rows of a KV-cache-sized array
  (`--cache-gb`), at blocks picked at random as an engine's free blocks are — no checksum;
- into the cache + checksum: the same, then XXH3 over what was read (what `Block.copy_into` does).

The share of the last against the plain reads is the most a load in the step can reach here, whatever the code
around it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

import numpy as np
import xxhash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=131)
    parser.add_argument("--block-mb", type=float, default=1.47)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--cache-gb", type=float, default=3.0, help="the engine's KV cache size the rows are in")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    per_layer = int(args.block_mb * 1e6) // args.layers // 64 * 64
    block_bytes = per_layer * args.layers
    rows = max(args.blocks, int(args.cache_gb * 1e9) // block_bytes)
    folder = tempfile.mkdtemp(prefix="spanq-read-ceiling-")
    try:
        paths = []
        for i in range(args.blocks):
            path = os.path.join(folder, f"{i}.kv")
            with open(path, "wb") as f:
                f.write(os.urandom(block_bytes))
            paths.append(path)
        cache = np.ones((args.layers, rows, per_layer), np.uint8)  # touched: no page faults while reading
        buffer = bytearray(block_bytes)
        total = block_bytes * args.blocks

        def plain_reused() -> None:
            for path in paths:
                with open(path, "rb", buffering=0) as f:
                    f.readinto(buffer)

        def plain_fresh() -> None:
            for path in paths:
                with open(path, "rb", buffering=0) as f:
                    f.read()

        def into_cache(checksum: bool) -> None:
            for path, row in zip(paths, random.sample(range(rows), args.blocks)):
                targets = [cache[layer, row] for layer in range(args.layers)]
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.preadv(fd, targets, 0)
                finally:
                    os.close(fd)
                if checksum:
                    digest = xxhash.xxh3_64()
                    for t in targets:
                        digest.update(t)

        cases = {
            "plain read, into one reused buffer": plain_reused,
            "plain read, into fresh memory (Path.read_bytes)": plain_fresh,
            "into the KV cache's rows, no checksum": lambda: into_cache(False),
            "into the KV cache's rows + XXH3 (a load's work)": lambda: into_cache(True),
        }
        plain_reused()  # the page cache holds every file from here on
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.reps):
            for name, run in cases.items():
                started = time.perf_counter()
                run()
                rates[name].append(total / (time.perf_counter() - started) / 1e6)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        print(f"{args.blocks} blocks x {block_bytes / 1e6:.2f} MB ({args.layers} parts each), median of {args.reps}:")
        for name, rate in medians.items():
            print(f"  {name:52s} {rate:7.0f} MB/s")
        load = medians["into the KV cache's rows + XXH3 (a load's work)"]
        for plain in ("plain read, into one reused buffer", "plain read, into fresh memory (Path.read_bytes)"):
            print(f"  a load's work / {plain}: {load / medians[plain]:.0%}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
