"""`spanq tier DIR`: what a span tier holds; `--check` reads every block against its checksum, `--clear` empties it.

A tier folder holds one namespace per model and setting (`spanq_backend/vllm_integration/tier.py`): a folder
named by a digest, with `namespace.json` saying what it was made of, and one file per KV block.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["check", "clear", "describe", "tier_main"]


def _namespaces(root: Path) -> list[Path]:
    """The namespace folders (a folder being cleared, renamed to a dotted name first, is none: `_leftovers`)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (p / "namespace.json").exists()) if root.is_dir() else []  # fmt: skip


LEFT_PREFIX = ".cleared-"  # a namespace being cleared (`clear`): renamed so, then removed


def _leftovers(root: Path, name: str | None = None) -> list[Path]:
    """What clears that failed half-way left (renamed away, not removed: a file that could not be removed), of one
    namespace or of all: no engine reads them, `--clear` removes them."""
    prefix = LEFT_PREFIX + (f"{name}-" if name else "")
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix)) if root.is_dir() else []


def _tree_bytes(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(_size(p) for p in files)


def _remove(folder: Path) -> None:
    """Remove a folder, again where a writer that had begun put a file in it meanwhile."""
    import time

    for attempt in range(5):
        try:
            shutil.rmtree(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == 4:
                raise
            time.sleep(0.1)


def _blocks(ns: Path) -> tuple[list[tuple[bytes, Path]], list[Path]]:
    """A namespace's block files (hash, path) and the `.kv` files not named by a block's hash (not an engine's:
    no engine reads them)."""
    blocks, stray = [], []
    for path in sorted(ns.glob("??/*.kv")):
        try:
            blocks.append((bytes.fromhex(path.stem), path))
        except ValueError:
            stray.append(path)
    return blocks, stray


def _about(ns: Path) -> tuple[dict[str, Any], str | None]:
    """What a namespace was made of (`namespace.json`), and why it cannot be read where it cannot (an engine on
    the namespace writes it again when it starts or saves)."""
    about = ns / "namespace.json"
    try:
        parsed = json.loads(about.read_text())
        if isinstance(parsed, dict):
            return parsed, None
        return {}, f"{about} is not an object"
    except (OSError, ValueError) as e:
        return {}, f"{about} cannot be read ({type(e).__name__}: {e})"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # removed since it was listed (an engine's eviction)
        return 0


def describe(root: Path) -> list[dict[str, Any]]:
    """Each namespace of the tier: its digest, what it was made of, its blocks, their bytes, the files set aside and
    the blocks pinned (`spanq prepare --pin`)."""
    out = []
    for ns in _namespaces(root):
        blocks, stray = _blocks(ns)
        about, damaged = _about(ns)
        out.append({
            "namespace": ns.name,
            "model": str(about.get("model", ""))[:12], "model_name": about.get("model_name"),  # (older tiers: no name)
            "dtype": about.get("dtype"), "block_size": about.get("block_size"),
            "vllm": about.get("vllm"), "blocks": len(blocks), "bytes": sum(_size(p) for _, p in blocks),
            # (one whose block was written again since is no longer set aside: it was still counted)
            "set_aside": sum(1 for bad in ns.glob("??/*.bad") if not bad.with_suffix(".kv").exists()),
            "pinned": sum(1 for _, p in blocks if p.with_suffix(".pin").exists()),
            "not_blocks": [str(p) for p in stray], "damaged": damaged,
        })
    return out


def check(root: Path) -> dict[str, Any]:
    """Read every block of every namespace against its checksum; those that fail are set aside (never loaded).
    `.kv` files not named by a block's hash are named and left alone."""
    from spanq_backend.vllm_integration.tier import DiskTier

    good = bad = 0
    stray_files: list[str] = []
    for ns in _namespaces(root):
        tier = DiskTier(root, ns.name)
        blocks, stray = _blocks(ns)
        stray_files += [str(p) for p in stray]
        for key, _ in blocks:
            try:
                tier.read(key)
                good += 1
            except FileNotFoundError:
                pass  # removed since the folder was listed (an engine's eviction): nothing to check
            except (OSError, ValueError) as e:
                tier.forget(key, str(e),
                            then="fails its check ({why}): set aside, an engine computes it again when a span needs it")
                bad += 1
    return {"good": good, "set_aside": bad, "not_blocks": stray_files}


def clear(root: Path, name: str) -> None:
    """Remove a namespace: renamed to a dotted name first (at once unlisted, and an engine writing to it makes it
    again: docs/design.md §10), then removed, again where a writer that had begun put a file in it meanwhile. Where a
    file cannot be removed, the renamed folder is left (listed by `spanq tier`, removed by the next `--clear`)."""
    import os
    import time

    gone = root / f"{LEFT_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(root / name, gone)
    except FileNotFoundError:  # cleared by another clear meanwhile
        return
    try:
        _remove(gone)
    except OSError as e:  # (rmtree names the file by its bare name): the folder it is left in, for the next clear
        raise OSError(e.errno, e.strerror, f"{gone}/…/{Path(str(e.filename)).name}" if e.filename else str(gone)) from e


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spanq tier", description=__doc__.splitlines()[0])
    parser.add_argument("dir", metavar="DIR", nargs="?", help="the span tier's folder")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="read every block against its checksum; set aside those "
                        "that fail (a set-aside block is computed again when a span needs it)")
    action.add_argument("--clear", nargs="?", const="all", metavar="NAMESPACE",
                        help="remove every namespace (or the one named) and its blocks")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    if args.dir is None:
        if args.clear in (None, "all"):
            parser.error("the following arguments are required: DIR")
        # `spanq tier --clear DIR`: the flag took the folder as the namespace it may name; nothing else is the folder
        args.dir, args.clear = args.clear, "all"
    return args


def tier_main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    root = Path(args.dir)
    if not root.is_dir():
        print(f"spanq tier: error: {root} is not a folder", file=sys.stderr)
        return 2
    if args.clear:
        names = [p.name for p in _namespaces(root)]
        if args.clear != "all" and args.clear not in names and not _leftovers(root, args.clear):
            print(f"spanq tier: error: {root} has no namespace {args.clear!r} (it has: {', '.join(names) or 'none'})",
                  file=sys.stderr)
            return 2
        removed = [n for n in names if args.clear in ("all", n)]
        for name in removed:
            try:
                clear(root, name)
            except OSError as e:
                print(f"spanq tier: error: cannot clear namespace {name} of {root}: {e.strerror or e} "
                      f"({e.filename or root}); what is left no engine reads, and `spanq tier {root} --clear` "
                      "removes it once it can", file=sys.stderr)  # fmt: skip
                return 1
        left = _leftovers(root, None if args.clear == "all" else args.clear)
        for folder in left:  # (a clear that failed half-way: listed since, removed now)
            try:
                _remove(folder)
            except OSError as e:
                print(f"spanq tier: error: cannot remove {folder}, left by a clear that failed: {e.strerror or e} "
                      f"({e.filename or folder})", file=sys.stderr)  # fmt: skip
                return 1
        print(json.dumps({"removed": removed, "left_by_failed_clears": [p.name for p in left]}) if args.json
              else f"removed {len(removed)} namespace(s) from {root}"
              + (f", and {len(left)} folder(s) left by a clear that failed" if left else ""))
        return 0
    if args.check:
        result = check(root)
        for path in result["not_blocks"]:
            print(f"spanq tier: {path}: not named as a block (no engine reads it); left alone", file=sys.stderr)
        print(json.dumps(result) if args.json else f"{result['good']} blocks good, {result['set_aside']} set aside")
        return 1 if result["set_aside"] else 0
    spaces = describe(root)
    for folder in _leftovers(root):
        files, size = _tree_bytes(folder)
        print(f"spanq tier: {folder}: left by a clear that failed ({files} files, {size / 1e6:.1f} MB; no engine reads "
              f"them): `spanq tier {root} --clear` removes it", file=sys.stderr)
    if args.json:
        print(json.dumps(spaces))
    elif not spaces:
        print(f"{root}: no span tier namespace")
    for s in [] if args.json else spaces:
        if s["damaged"]:
            print(f"spanq tier: {s['damaged']}; an engine started on this namespace writes it again", file=sys.stderr)
        model = f"{s['model_name']} ({s['model']}…)" if s["model_name"] else f"{s['model']}…"
        print(f"{s['namespace']}  model {model}  {s['dtype']}  blocks of {s['block_size']}  vLLM {s['vllm']}: "
              f"{s['blocks']} blocks, {s['bytes'] / 1e6:.1f} MB" + (f", {s['pinned']} pinned" if s["pinned"] else "")
              + (f", {s['set_aside']} set aside" if s["set_aside"] else ""))
    return 0
