"""`spanq prepare CORPUS --tier-dir DIR`: compile a corpus into a span tier.

Each document's span KV (`[anchor][document]`, as a query's `plus` of it is prepared under the engine's default
anchor and lead-in) is computed once and written to the tier; an engine started later on the same tier
(`SpanEngine(tier_dir=...)`, `spanq serve --tier-dir`) loads it instead of computing it, after a restart or on
another replica. The corpus is JSON lines, one document each: a JSON string, or an object with its text under
`text`, `page_content` (LangChain's documents) or `content`; or one JSON array of those; or a LangChain
`InMemoryVectorStore` dump; or the folder a LlamaIndex index was persisted to (`read_corpus`). A line that is not
a document is named by its number and the rest are compiled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["TEXT_KEYS", "located_corpus", "prepare_main", "read_corpus", "text_of"]

TEXT_KEYS = ("text", "page_content", "content")


def text_of(item: Any) -> str | None:
    """A document's text: a non-blank JSON string, or an object's under one of `TEXT_KEYS`; None otherwise."""
    if isinstance(item, str):
        return item if item.strip() else None
    if isinstance(item, dict):
        for key in TEXT_KEYS:
            if isinstance(item.get(key), str) and item[key].strip():
                return item[key]
    return None


def _vector_store_dump(raw: str) -> list[str] | None:
    """The documents' texts of a LangChain `InMemoryVectorStore.dump` file (an object of id -> {"id", "vector",
    "text", "metadata"}), or None if `raw` is not one."""
    if not raw.lstrip().startswith("{"):
        return None
    try:
        whole = json.loads(raw)
    except json.JSONDecodeError:
        return None  # JSON lines
    if not isinstance(whole, dict) or not whole or not all(
        isinstance(v, dict) and "vector" in v and isinstance(v.get("text"), str) for v in whole.values()
    ):
        return None
    return [v["text"] for v in whole.values() if v["text"].strip()]


def read_corpus(path: Path) -> tuple[list[str], list[str]]:
    """The documents of a corpus, and what was wrong with the lines that are not documents (`located_corpus`'s,
    without where each document was read)."""
    located, problems = located_corpus(path)
    return [text for _, text in located], problems


class _NotUtf8(str):
    """A JSON line whose bytes are not UTF-8 text: what the decoder said."""


def located_corpus(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """The documents of a corpus, each with where it was read (`PATH:LINE`, `PATH: item I`), and what was wrong
    with the lines that are not documents. A corpus is a file of JSON lines or one JSON array; a LangChain
    `InMemoryVectorStore` dump (`store.dump(PATH)`: each document's `page_content`, as `format_docs_as_spans`
    sends it); or the folder a LlamaIndex index was persisted to (its nodes' text as `SpanQuerySynthesizer` sends
    it, `spanq_integrations.llamaindex.corpus_texts`). A JSON line that is not UTF-8 text is named and the rest
    read, as any other line that is not a document."""
    if path.is_dir():
        try:
            from spanq_integrations.llamaindex.corpus import corpus_texts
        except ImportError:
            raise ValueError(f"{path} is a folder: reading a persisted LlamaIndex index needs the llamaindex "
                             "extra (pip install 'spanq[llamaindex]')") from None
        return [(f"{path}: node {i}", text) for i, text in enumerate(corpus_texts(path))], []
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # (a byte-order mark is not part of the first document)
    try:
        raw = data.decode("utf-8")
        lines: list[str] = raw.split("\n")
    except UnicodeDecodeError as e:  # (its message named no file, nor a line)
        line = data.count(b"\n", 0, e.start) + 1
        if data.lstrip()[:1] == b"[":
            raise ValueError(f"cannot read {path}: line {line} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        raw, lines = "", []
        for chunk in data.split(b"\n"):
            try:
                lines.append(chunk.decode("utf-8"))
            except UnicodeDecodeError as bad:
                lines.append(_NotUtf8(f"not UTF-8 text ({bad.reason} at column {bad.start + 1})"))
    if raw and (dumped := _vector_store_dump(raw)) is not None:
        return [(f"{path}: document {i}", text) for i, text in enumerate(dumped)], []
    entries: list[tuple[str, Any]] = []  # (where, the item or the error that stands for it)
    if raw.lstrip().startswith("["):
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON array of documents: {e}") from None
        entries = [(f"{path}: item {i}", item) for i, item in enumerate(items)]
    else:
        # JSON Lines end lines at "\n" only: a document may hold U+2028, U+0085 or a form feed unescaped, which
        # `str.splitlines` would cut it at.
        for n, line in enumerate(lines, start=1):
            if isinstance(line, _NotUtf8):
                entries.append((f"{path}:{n}", line))
            elif line.strip():
                try:
                    entries.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    entries.append((f"{path}:{n}", e))
    from spanq_backend.serving.corpus import unicode_problem

    located: list[tuple[str, str]] = []
    problems: list[str] = []
    for where, item in entries:
        if isinstance(item, _NotUtf8):
            problems.append(f"{where}: {item}")
        elif isinstance(item, json.JSONDecodeError):
            problems.append(f"{where}: not JSON ({item.msg})")
        elif (text := text_of(item)) is None:
            blank = isinstance(item, str) or (isinstance(item, dict) and any(isinstance(item.get(k), str) for k in TEXT_KEYS))
            problems.append(f"{where}: an empty document (its text is blank)" if blank else
                            f"{where}: not a document (a string, or an object with one of {', '.join(TEXT_KEYS)})")
        elif (bad := unicode_problem(text)) is not None:  # (no tokenizer reads it)
            problems.append(f"{where}: {bad}")
        else:
            located.append((where, text))
    return located, problems


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="spanq prepare",
        description="Compute each document's span KV once and write it to a span tier (a folder), where engines "
        "started on it later find it (--tier-dir); or have a running `spanq serve` prepare it, and pin it in its KV "
        "cache with --pin (--server).",
    )
    parser.add_argument("corpus", metavar="CORPUS", help="JSON lines, one document each (a string, or an object "
                        "with text, page_content or content), or one JSON array of them; a LangChain "
                        "InMemoryVectorStore dump (store.dump(PATH)); or the folder a LlamaIndex index was "
                        "persisted to (storage_context.persist(DIR))")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--tier-dir", metavar="DIR", help="the span tier's folder (made if need be)")
    where.add_argument("--server", metavar="URL", help="a running `spanq serve` (http://host:port): it prepares "
                       "the corpus in its engine (and its own tier, if it has one); with --pin it keeps the corpus "
                       "in its KV cache until `curl -X DELETE URL/v1/spans/pin`. Sends $SPANQ_API_KEY, if set")
    parser.add_argument("--model", default="default", metavar="NAME", help="the model the KV is for: default, tiny, "
                        "tiny-<family>, a model folder or a Hugging Face id (default: default)")
    parser.add_argument("--pin", action="store_true", help="pin the corpus's blocks in the tier: never removed to "
                        "make room (engines started with --tier-max-gb evict the least recently used others); "
                        "with --server, in the server's KV cache (at most half of it)")
    parser.add_argument("--tier-max-gb", type=float, default=None, metavar="GB", help="the tier's capacity while "
                        "compiling: past it the least recently used unpinned blocks are removed (default: no limit)")
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = parser.parse_args(argv)
    if args.server is not None:
        if args.tier_max_gb is not None or args.model != "default":
            parser.error("--server prepares on the server's own engine and tier: --model and --tier-max-gb are its")
        if not args.server.removeprefix("spanq+").startswith(("http://", "https://")):
            parser.error(f"--server: expected a URL such as http://127.0.0.1:8000, got {args.server!r}")
    return args


SERVER_BATCH = 256  # documents per request to a server (its --max-fragments is 512 unless set lower)


def prepare_on_server(url: str, texts: list[str], pin: bool) -> dict[str, Any]:
    """`POST URL/v1/spans` in batches: the server prepares (and pins) the documents; the reports summed. A
    `RuntimeError` with the server's own message where it refuses or cannot be reached."""
    import os
    import urllib.error
    import urllib.request

    from spanq_integrations.backends._http import normalize_base_url
    from spanq_integrations.backends.resolve import API_KEY_ENV
    from spanq_integrations.query.errors import SpanQueryError

    try:  # (the root, as `spanq run --backend` reads it: an OpenAI base URL's `/v1` asked `/v1/v1/spans`, a 404)
        url = normalize_base_url(url.strip().removeprefix("spanq+"))
    except SpanQueryError as e:
        raise RuntimeError(str(e)) from None
    headers = {"Content-Type": "application/json"}
    if os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
    total: dict[str, Any] = {}
    for start in range(0, len(texts), SERVER_BATCH):
        body = json.dumps({"documents": texts[start : start + SERVER_BATCH], "pin": pin}).encode()
        request = urllib.request.Request(f"{url}/v1/spans", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request) as response:  # no timeout: a CPU engine takes its time
                report = json.load(response)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise RuntimeError(f"{url} answered {e.code}: {detail[:500]}") from None
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None
        for key, value in report.items():
            if key == "too_long_documents":
                total.setdefault(key, []).extend(start + i for i in value)
            elif key == "pinned_total":
                total[key] = value
            elif isinstance(value, int):
                total[key] = total.get(key, 0) + value
    return total


def prepare_main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    corpus = Path(args.corpus)
    try:
        located, problems = located_corpus(corpus)
    except (OSError, ValueError) as e:
        print(f"spanq prepare: error: {e}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"spanq prepare: skipped {problem}", file=sys.stderr)
    texts = [text for _, text in located]
    wheres = [where for where, _ in located]
    if not texts:
        print(f"spanq prepare: error: {corpus} holds no document", file=sys.stderr)
        return 2
    if args.server is not None:
        return _report_server(args, texts, wheres, problems)
    from spanq_backend.serving.engine import EngineConfig, SpanEngine
    from spanq_integrations.query.errors import SpanQueryError

    started = time.perf_counter()
    try:
        from spanq_backend.vllm_integration.tier import gb_to_bytes

        config = EngineConfig(model=args.model, tier_dir=args.tier_dir, tier_max_bytes=gb_to_bytes(args.tier_max_gb),
                              tier_pin=args.pin)
        with SpanEngine(config) as engine:
            report = asyncio.run(engine.compile(texts))
            report["tier"] = str(engine.tier.dir) if engine.tier is not None else None
    except (SpanQueryError, ValueError) as e:
        print(f"spanq prepare: error: {e}", file=sys.stderr)
        return 2
    _name_too_long(report, wheres)
    if (said := eviction_message(report.get("blocks_evicted", 0), args.tier_max_gb, args.pin)) is not None:
        print(said, file=sys.stderr)
    report["skipped_lines"] = len(problems)
    report["seconds"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['documents']} documents, {report['spans']} spans: {report['prepared']} prepared "
            f"({report['tokens']} tokens computed), {report['held']} already in the tier; "
            f"{report.get('blocks_written', 0)} blocks ({report.get('bytes_written', 0) / 1e6:.1f} MB) written to "
            f"{report['tier']} in {report['seconds']} s"
            + (f"; {report['blocks_evicted']} blocks removed again to keep within --tier-max-gb (see the warning)"
               if report.get("blocks_evicted") else "")
        )
    return 1 if problems or report.get("too_long") else 0


def eviction_message(evicted: int, max_gb: float | None, pin: bool) -> str | None:
    """What `spanq prepare` says of the blocks removed to keep a tier within its capacity: with --pin they were
    others than the corpus's (pinned blocks stay), without it the corpus's first documents may be among them."""
    if not evicted:
        return None
    if pin:
        return (f"spanq prepare: {evicted} unpinned blocks were removed to keep the tier within --tier-max-gb "
                f"{max_gb:g} (the least recently used; this corpus's blocks are pinned and stay)")
    return (f"spanq prepare: warning: {evicted} blocks were removed to keep the tier within --tier-max-gb {max_gb:g} "
            "(the least recently used: this corpus's first documents too, unless pinned with --pin); a larger capacity "
            "keeps the whole corpus")


def _name_too_long(report: dict[str, Any], wheres: list[str]) -> None:
    """Each document too long for the model's window named where it was read (the report's indices count the
    documents read, not the file's lines: once a line was skipped they named no line of the file)."""
    report["too_long_where"] = [wheres[i] for i in report.get("too_long_documents", [])]
    for where in report["too_long_where"]:
        print(f"spanq prepare: skipped {where}: too long for the model's context window", file=sys.stderr)


def _report_server(args: argparse.Namespace, texts: list[str], wheres: list[str], problems: list[str]) -> int:
    started = time.perf_counter()
    try:
        report = prepare_on_server(args.server, texts, args.pin)
    except RuntimeError as e:
        print(f"spanq prepare: error: {e}", file=sys.stderr)
        return 2
    _name_too_long(report, wheres)
    report["skipped_lines"] = len(problems)
    report["seconds"] = round(time.perf_counter() - started, 2)
    if args.json:
        print(json.dumps(report))
    else:
        pinned = (f"; {report.get('pinned_blocks', 0)} blocks pinned ({report.get('pin_refused', 0)} refused past half "
                  f"the cache), {report.get('pinned_total', 0)} pinned in all") if args.pin else ""
        print(
            f"{report['documents']} documents, {report['spans']} spans: {report['prepared']} prepared on "
            f"{args.server} ({report['tokens']} tokens computed), {report['held']} already held{pinned}, in "
            f"{report['seconds']} s"
        )
    return 1 if problems or report.get("too_long") else 0
