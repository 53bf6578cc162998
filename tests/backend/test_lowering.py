"""spanq_backend.serving.lowering: a closed generate input → prompt tokens and a span table, with SmolLM2's chat template.

Uses the real SmolLM2 tokenizer (from the tiny model's folder): spans sit on block boundaries, each span's
tokens are its own text's tokens (independent of its neighbours and of the order), the anchor is the chat
template's prefix, and the whole prompt is the chat template's rendering plus padding.
"""

from __future__ import annotations

import re

import pytest

from spanq_backend.serving.lowering import NEUTRAL_LEAD_IN, LoweredPrompt, lower, span_order
from spanq_integrations.query.errors import ContextLengthError, QueryValidationError
from spanq_integrations.query.flatten import to_chat_messages
from spanq_integrations.query.ir import (
    Cross,
    Print,
    assistant,
    cross,
    fragment,
    generate,
    plus,
    system,
    user,
)

BS = 16
SYSTEM = "You answer from the documents only."
DOCS = {
    "A": "Alpha: the red door opens at dawn.",
    "B": "Beta: the blue lamp is lit by a long, winding procedure that takes well over sixteen tokens to describe.",
    "C": "Gamma: ninety-nine bottles.",
    "D": "Delta: the road goes ever on and on, down from the door where it began.",
}
QUESTION = "Which door opens at dawn?"


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def newline(tok) -> int:
    """The pad token the span generator uses: a newline."""
    return tok.encode("\n", add_special_tokens=False)[-1]


@pytest.fixture(scope="module")
def marker(tok) -> int:
    """A pad token that no text here produces, so padding can be counted."""
    return tok.convert_tokens_to_ids("<empty_output>")


def rag(order: str = "ABCD", question: str = QUESTION):
    return cross(system(SYSTEM), plus(*[fragment(DOCS[c]) for c in order]), user(question))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def unpadded(lp: LoweredPrompt, pad: int) -> list[int]:
    return [t for t in lp.token_ids if t != pad]


def squeeze_newlines(text: str) -> str:
    return re.sub(r"\n+", "\n", text)


# --------------------------------------------------------------------------------------------- layout


def test_spans_and_anchor_sit_on_block_boundaries(tok, newline):
    lp = lower(rag(), tok, BS, newline)
    assert lp.has_spans and len(lp.table.spans) == 4
    assert lp.table.block_size == BS
    assert lp.table.anchor_len > 0 and lp.table.anchor_len % BS == 0
    for s, e in lp.table.spans:
        assert s % BS == 0 and e % BS == 0 and e > s
    # ascending, adjacent (nothing between the children of one plus), after the anchor
    assert lp.table.spans[0][0] == lp.table.anchor_len
    for (_, e), (s, _) in zip(lp.table.spans, lp.table.spans[1:]):
        assert e == s


def test_anchor_is_the_chat_template_prefix(tok, marker):
    lp = lower(rag(), tok, BS, marker)
    anchor_text = tok.decode([t for t in lp.anchor_ids if t != marker])
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "X"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered.startswith(anchor_text)
    assert anchor_text.startswith("<|im_start|>system\n")
    assert SYSTEM in anchor_text
    assert anchor_text.endswith("<|im_start|>user\n")
    assert DOCS["A"] not in anchor_text


def test_each_span_is_its_own_text_then_a_separator_then_padding(tok, marker):
    lp = lower(rag(), tok, BS, marker)
    sep = enc(tok, "\n\n")
    assert sorted(lp.span_texts) == sorted(DOCS.values())
    for i, text in enumerate(lp.span_texts[:3]):  # the last keeps its tail as context (below)
        own = enc(tok, text) + sep
        ids = lp.span_ids(i)
        assert ids[: len(own)] == own, text
        assert ids[len(own) :] == [marker] * (len(ids) - len(own)), text
        assert len(ids) - len(own) < BS


def test_the_last_span_keeps_its_tail_as_context_without_padding(tok, marker):
    """The question follows the last span: its whole blocks are the span (the same blocks as where it is padded),
    its last partial block is context, unpadded, and prepared padded; a span shorter than a block stays padded."""
    lp = lower(rag("BD"), tok, BS, marker)  # (D's tail is the shorter: it stays last)
    own = enc(tok, DOCS["D"]) + enc(tok, "\n\n")
    assert len(own) > BS and len(own) % BS  # a whole block and a tail
    assert lp.span_texts == [DOCS["B"], DOCS["D"]]
    s, e = lp.table.spans[1]
    assert e - s == len(own) // BS * BS and lp.span_ids(1) == own[: e - s]
    assert lp.token_ids[e : s + len(own)] == own[e - s :]  # the tail, then the question: no padding
    assert all(lp.table.span_at(t) is None for t in range(e, len(lp.token_ids)))
    da = lower(rag("DA"), tok, BS, marker)  # (A, shorter than a block, has no tail: it stays last)
    assert da.span_texts == [DOCS["D"], DOCS["A"]]
    assert da.span_ids(0) == own + [marker] * ((-len(own)) % BS)  # D not last: padded
    assert lp.span_ids(1) == da.span_ids(0)[: e - s]  # the same whole blocks
    assert lp.prepare_prompt(1) == da.prepare_prompt(0)  # prepared padded: one cached span in both places
    short = enc(tok, DOCS["A"]) + enc(tok, "\n\n")
    assert len(short) < BS and da.span_ids(1) == short + [marker] * (BS - len(short))  # no whole block: padded
    bda = lower(rag("BDA"), tok, BS, marker)
    assert lp.padded_tokens == bda.padded_tokens - (BS - len(short)) - (-len(own)) % BS


def test_a_group_is_read_in_one_order_for_its_set_with_the_shortest_tail_last(tok, marker):
    """A `plus` says its order does not matter: a group of text spans is read in one order that depends only on
    which spans it holds (so a set read again in another order finds its blocks where they sit), with the span
    whose tail is shortest last (the request computes the last span's tail; a span shorter than a block has
    none). The check fails on the given order: other permutations, other layouts, a longer tail computed."""
    from itertools import permutations

    from spanq_backend.serving import lowering

    tails = {name: 0 if (n := len(enc(tok, text) + enc(tok, "\n\n"))) < BS else n % BS for name, text in DOCS.items()}
    assert tails["B"] > tails["D"] > 0 == tails["A"] == tails["C"]
    name = {v: k for k, v in DOCS.items()}

    def computed(lp: LoweredPrompt) -> int:  # what the request computes after the last span's whole blocks
        return len(lp.token_ids) - lp.table.spans[-1][1]

    def layouts(group: str) -> set[tuple[str, ...]]:
        return {tuple(name[t] for t in lower(rag("".join(p)), tok, BS, marker).span_texts) for p in permutations(group)}

    question = computed(lower(rag("BDA"), tok, BS, marker, keep_order=True))  # A last: padded, nothing computed
    for group in ("BD", "ABD", "ABCD", "AC", "BCD"):
        (read,) = layouts(group)  # one layout for every order given
        assert sorted(read) == sorted(group) and tails[read[-1]] == min(tails[c] for c in group), (group, read)
        assert computed(lower(rag(group), tok, BS, marker)) == question + tails[read[-1]], group
    # where nothing moves (no text group, or a candidate that is not a text span) the order is the given one
    assert lower(cross(system(SYSTEM), plus(fragment(DOCS["B"]), plus("x", "y")), user(QUESTION)), tok, BS,
                 marker).span_texts[0] == DOCS["B"]
    assert lower(rag("DB"), tok, BS, marker, keep_order=True).span_texts == [DOCS["D"], DOCS["B"]]  # as given
    # an empty document (a retriever can return one) adds nothing, and leaves the group's one order as it is
    (read,) = layouts("ABD")
    for given in ("ABD", "DBA"):
        with_empty = cross(system(SYSTEM), plus(fragment(""), *[fragment(DOCS[c]) for c in given]), user(QUESTION))
        assert tuple(name[t] for t in lower(with_empty, tok, BS, marker).span_texts) == read, given
    kept = lowering.span_order
    try:
        lowering.span_order = lambda node, *_: node  # broken: the given order
        assert len(layouts("ABD")) == 6
        assert computed(lower(rag("DB"), tok, BS, marker)) == question + tails["B"] > question + tails["D"]
    finally:
        lowering.span_order = kept


def test_span_tokens_do_not_depend_on_the_order_or_the_neighbours(tok, newline):
    """A document's blocks are the same wherever it sits; last (its tail left as context), it keeps its whole
    blocks only."""
    abdc = lower(rag("ABDC"), tok, BS, newline, keep_order=True)  # C (shorter than a block) last
    dbca = lower(rag("DCBA"), tok, BS, newline, keep_order=True)  # A (as short) last
    name = {v: k for k, v in DOCS.items()}
    assert [name[t] for t in abdc.span_texts] == list("ABDC") and [name[t] for t in dbca.span_texts] == list("DCBA")
    padded = {name[t]: abdc.span_ids(i) for i, t in enumerate(abdc.span_texts[:3])} | {"C": dbca.span_ids(1)}
    for lp in (abdc, dbca):
        for i, text in enumerate(lp.span_texts[:3]):
            assert lp.span_ids(i) == padded[name[text]], name[text]
    for lp in [abdc, dbca] + [lower(rag(c), tok, BS, newline) for c in "ABCD"] + [lower(rag("DB"), tok, BS, newline)]:
        last = name[lp.span_texts[-1]]
        ids = lp.span_ids(len(lp.table.spans) - 1)  # last: its whole blocks (padded if it has none)
        assert ids == padded[last][: len(ids)] and len(padded[last]) - len(ids) in (0, BS), last
    assert abdc.anchor_ids == dbca.anchor_ids == lower(rag("B"), tok, BS, newline).anchor_ids


def test_prepare_prompt_is_the_prefix_then_the_span_under_the_prefix_policy(tok, newline):
    lp = lower(rag("BD"), tok, BS, newline, default_anchor="prefix")  # D last, with a tail
    assert lp.table.anchors is None and not lp.reads_after_another_prefix
    for i in range(2):
        s, e = lp.table.spans[i]
        head = lp.token_ids[: lp.table.anchor_len] + lp.token_ids[s:e]
        assert lp.prepare_prompt(i)[: len(head)] == head and len(lp.prepare_prompt(i)) % BS == 0
        assert (len(lp.prepare_prompt(i)) > len(head)) == (i == 1)  # the last: its tail block, padded
    # the key of a span follows its tokens, not its place (last, with its tail as context, too: D is prepared
    # padded, as where it is not last)
    other = lower(rag("BDA"), tok, BS, newline, default_anchor="prefix")  # A last (no tail), D padded
    assert other.span_texts == [DOCS["B"], DOCS["D"], DOCS["A"]]
    assert lp.span_key(0) == other.span_key(0)  # B
    assert lp.span_key(1) == other.span_key(1)  # D
    assert other.prepare_prompt(1) == lp.prepare_prompt(1)
    assert len({other.span_key(i) for i in range(3)}) == 3


def test_the_template_anchor_is_the_same_whatever_precedes_the_documents(tok, newline):
    """The default: each document's anchor is the chat template's opening of a user turn, so the same document
    is prepared the same way after any question, system prompt or conversation."""
    question_first = cross(user("Question: " + QUESTION + "\nContext:"), plus(*[fragment(DOCS[c]) for c in "CADB"]))
    chatty = cross(system("Be brief."), user("hi!"), assistant("Hello."), plus(*[fragment(DOCS[c]) for c in "BDAC"]),
                   user(QUESTION))
    prompts = {c: [] for c in "ABCD"}
    name = {v: k for k, v in DOCS.items()}
    for query in (rag("ABCD"), question_first, chatty):
        lp = lower(query, tok, BS, newline)
        assert lp.reads_after_another_prefix
        for i, c in enumerate(name[t] for t in lp.span_texts):
            if i in lp.prepare_tails:
                continue  # the last, with a tail: kept as context (its prepare adds it, padded)
            anchor = lp.table.anchor_of(i)
            assert isinstance(anchor, tuple) and len(anchor) % BS == 0
            s, e = lp.table.spans[i]
            assert lp.prepare_prompt(i) == list(anchor) + lp.token_ids[s:e]
            prompts[c].append(lp.prepare_prompt(i))
        assert lp.prefix_prompt() == lp.token_ids[: lp.table.anchor_len]
    for c, seen in prompts.items():
        assert len(seen) >= 2 and all(p == seen[0] for p in seen), f"document {c} is prepared differently after another prefix"
    # The opening of a user turn, then the lead-in (what each document reads first: other documents' kind of text).
    head = tok.decode(list(lower(rag(), tok, BS, newline).table.anchor_of(0))).rstrip("\n")
    assert head.endswith(NEUTRAL_LEAD_IN) and SYSTEM not in head
    assert head.removesuffix(NEUTRAL_LEAD_IN).rstrip("\n").endswith("<|im_start|>user")
    bare = tok.decode(list(lower(rag(), tok, BS, newline, lead_in="").table.anchor_of(0))).rstrip("\n")
    assert bare.endswith("<|im_start|>user") and SYSTEM not in bare


def test_documents_of_a_system_message_stay_in_it_and_are_the_same_spans_as_a_user_turn_s(tok, marker):
    """A group with `role="system"` (documents an app puts in its system prompt) is laid out inside the system
    message, as the stock prompt has them; each document is prepared as in a user turn (the template anchor), so
    both find one cached copy."""
    in_system = cross(system(SYSTEM), plus(*[fragment(DOCS[c]) for c in "ABCD"], role="system"), user(QUESTION))
    lp = lower(in_system, tok, BS, marker)
    rendered = tok.apply_chat_template(to_chat_messages(span_order(in_system, tok, BS)), tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
    def layout(text: str) -> str:  # padding, and the separator the last span ends with before the message's end
        return squeeze_newlines(text).replace("\n<|im_end|>", "<|im_end|>")

    assert layout(tok.decode(unpadded(lp, marker))) == layout(rendered)
    assert rendered.count("<|im_start|>") == 3 and DOCS["A"] in rendered.split("<|im_start|>user")[0]
    in_user = lower(rag("ABCD"), tok, BS, marker)
    assert lp.span_texts == in_user.span_texts
    for i in range(len(lp.span_texts)):
        assert lp.prepare_prompt(i) == in_user.prepare_prompt(i)
    # A system message of documents only holds no system prompt: the "system" anchor is the template's then (it
    # rendered an empty system message, which neither stock nor the template anchor reads).
    only_docs = lower(cross(plus(*[fragment(DOCS[c]) for c in "AB"], role="system", anchor="system"), user(QUESTION)),
                      tok, BS, marker)  # fmt: skip
    templated = lower(cross(plus(*[fragment(DOCS[c]) for c in "AB"], role="system"), user(QUESTION)), tok, BS, marker)
    assert only_docs.table.anchor_of(0) == templated.table.anchor_of(0)


@pytest.mark.parametrize("groups", ["prefix", "prefix and template"])
def test_a_group_read_in_context_before_the_spans_leaves_their_prefix_anchor_as_it_was(tok, newline, groups):
    """A first group all cold, read in context (`as_context`, the "context" policy's layout), puts text before
    the first span: a span anchored on the prefix must still be prepared after the prefix alone, as when that
    group is a span. It raised `SpanTableError` beside a template-anchored group (an integer anchor that was no
    longer the table's prefix), and alone was silently re-anchored on the in-context text (every block missed)."""
    tail = [plus(fragment(DOCS["A"]), fragment(DOCS["B"]), anchor="prefix")]
    if groups == "prefix and template":
        tail = [plus(fragment(DOCS["A"]), anchor="prefix"), plus(fragment(DOCS["B"]))]
    query = cross(system(SYSTEM), plus(fragment(DOCS["C"])), *tail, user(QUESTION))
    as_spans = lower(query, tok, BS, newline)
    relaid = lower(query, tok, BS, newline, as_context=frozenset({DOCS["C"]}))
    assert relaid.span_texts == [t for t in as_spans.span_texts if t != DOCS["C"]]
    for i, text in enumerate(relaid.span_texts):
        if i in relaid.prepare_tails:
            continue  # the last, with a tail kept as context: its prepare adds it, padded
        assert relaid.prepare_prompt(i) == as_spans.prepare_prompt(as_spans.span_texts.index(text)), text


def test_the_question_is_what_follows_every_document_and_else_what_precedes_them(tok, newline):
    """`recompute="question"` (the default) chooses the blocks the question shares words with. A document read in
    context after the spans (a cold one, a repeated one) was read as part of the question, so blocks were chosen
    for sharing another document's words; and with the question before the documents (LangChain hub's
    rlm/rag-prompt: "Question: … Context: … Answer:") nothing after them was shared and nothing was recomputed."""
    from spanq_backend.serving.recompute import choose_blocks, question_start

    relaid = lower(rag("ABD"), tok, BS, newline, as_context=frozenset({DOCS["D"]}))
    after = tok.decode(relaid.token_ids[question_start(relaid, newline) :])
    assert QUESTION in after and "Delta" not in after, after
    asked_first = cross(user(f"Question: {QUESTION}\nContext:"), plus(*[fragment(DOCS[c]) for c in "ABCD"]),
                        user("Answer:"))  # fmt: skip
    low = lower(asked_first, tok, BS, newline)
    chosen = choose_blocks(low, "question", newline)
    assert DOCS["A"] in [low.span_texts[i] for i, _ in chosen], chosen  # the door that opens at dawn


def test_a_span_too_long_to_follow_the_lead_in_is_prepared_without_it(tok, newline):
    """The lead-in must not make a document that fits the window unpreparable: such a span's anchor is the bare
    opening."""
    query = cross(system(SYSTEM), plus(fragment("word " * 300)), user(QUESTION))
    n = len(lower(query, tok, BS, newline).token_ids)
    lp = lower(query, tok, BS, newline, max_model_len=n + 40)
    assert lp.prepare_prompt(0)[: len(lp.table.anchor_of(0))] == list(lp.table.anchor_of(0))
    assert tok.decode(list(lp.table.anchor_of(0))).rstrip("\n").endswith("<|im_start|>user")
    roomy = lower(query, tok, BS, newline, max_model_len=4096)
    assert tok.decode(list(roomy.table.anchor_of(0))).rstrip("\n").endswith(NEUTRAL_LEAD_IN)


def test_the_system_anchor_is_the_prompts_own_system_message(tok, newline):
    """Two system parts render as one system message in the prompt: the anchor is that message, so a prompt that
    opens with it and nothing else is anchored on its own prefix (no extra tokens, no extra prepare)."""
    lp = lower(cross(system("A."), system("B."), plus(*[fragment(DOCS[c]) for c in "AB"], anchor="system"),
                     user("Q?")), tok, BS, newline, lead_in="")
    assert lp.table.anchors is None and not lp.reads_after_another_prefix
    # With a lead-in (the default) the anchor is that message and the lead-in: explicit tokens, the prefix apart.
    led = lower(cross(system("A."), system("B."), plus(*[fragment(DOCS[c]) for c in "AB"], anchor="system"),
                      user("Q?")), tok, BS, newline)
    assert led.table.anchors is not None and led.reads_after_another_prefix
    assert list(led.table.anchor_of(0))[: len(lp.prefix_prompt()) - BS] == lp.prefix_prompt()[: len(lp.prefix_prompt()) - BS]
    long_system = "word " * 20000  # an anchor too long to travel as tokens falls back to the exact prefix
    lp = lower(cross(system(long_system), user("Q?"), plus(*[fragment(DOCS[c]) for c in "AB"], anchor="system")),
               tok, BS, newline)
    assert lp.table.anchors is None


def test_the_system_anchor_keeps_the_system_prompt(tok, newline):
    lp = lower(cross(system(SYSTEM), user("Q?"), plus(*[fragment(DOCS[c]) for c in "AB"], anchor="system")),
               tok, BS, newline)
    head = tok.decode(list(lp.table.anchor_of(0)))
    assert SYSTEM in head and "Q?" not in head


def test_prompt_is_the_chat_template_rendering(tok, marker):
    lp = lower(rag(), tok, BS, marker)
    messages = to_chat_messages(span_order(rag(), tok, BS))  # the group as it is read
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    decoded = tok.decode(unpadded(lp, marker))
    assert squeeze_newlines(decoded) == squeeze_newlines(rendered)
    assert decoded.endswith(QUESTION + "<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_with_newline_padding_decodes_to_the_rendering(tok, newline):
    lp = lower(rag("DB"), tok, BS, newline)
    rendered = tok.apply_chat_template(
        to_chat_messages(span_order(rag("DB"), tok, BS)), tokenize=False, add_generation_prompt=True
    )
    assert squeeze_newlines(tok.decode(lp.token_ids)) == squeeze_newlines(rendered)


def test_padded_tokens_counts_exactly_the_padding(tok, marker):
    for query in (
        rag(),
        rag("B"),
        cross(system(SYSTEM), plus("x"), user("Between."), plus("y", "z"), user("Q")),
    ):
        lp = lower(query, tok, BS, marker)
        assert lp.padded_tokens == lp.token_ids.count(marker)
        assert lp.padded_tokens > 0


def test_padding_fills_each_block_only_up_to_its_boundary(tok, marker):
    lp = lower(rag(), tok, BS, marker)
    for s, e in ((0, lp.table.anchor_len), *lp.table.spans):
        ids = lp.token_ids[s:e]
        n_pad = ids.count(marker)
        assert ids[len(ids) - n_pad :] == [marker] * n_pad  # padding only at the end
        assert n_pad < BS


def test_without_plus_there_are_no_spans_and_the_tokens_are_the_templates(tok, newline):
    query = cross(
        system(SYSTEM), user("Hello."), assistant("Hi! How can I help?"), user(QUESTION), fragment("A note.")
    )
    lp = lower(query, tok, BS, newline)
    assert not lp.has_spans
    assert lp.table.spans == () and lp.table.anchor_len == 0
    assert lp.padded_tokens == 0
    expected = tok.apply_chat_template(to_chat_messages(query), tokenize=True, add_generation_prompt=True)
    assert lp.token_ids == list(expected["input_ids"])


def test_text_between_two_plus_groups_is_context(tok, marker):
    between = "Now compare those with these:"
    query = cross(
        system(SYSTEM), plus(DOCS["A"], DOCS["B"]), user(between), plus(DOCS["C"], DOCS["D"]), user(QUESTION)
    )
    lp = lower(query, tok, BS, marker)
    assert len(lp.table.spans) == 4
    (_, end_b), (start_c, _) = lp.table.spans[1], lp.table.spans[2]
    assert start_c > end_b and start_c % BS == 0
    context = lp.token_ids[end_b:start_c]
    assert between in tok.decode(context)
    assert all(lp.table.span_at(t) is None for t in range(end_b, start_c))
    # the spans after it are still their own text
    assert lp.span_ids(2)[: len(enc(tok, lp.span_texts[2]))] == enc(tok, lp.span_texts[2])
    read = span_order(query, tok, BS)  # each group as it is read
    rendered = tok.apply_chat_template(to_chat_messages(read), tokenize=False, add_generation_prompt=True)
    assert squeeze_newlines(tok.decode(unpadded(lp, marker))) == squeeze_newlines(rendered)


@pytest.mark.parametrize(
    "query",
    [
        cross(
            system(SYSTEM), plus(DOCS["A"], DOCS["B"]), assistant("Noted."), plus(DOCS["C"]), user(QUESTION)
        ),
        cross(system(SYSTEM), user("Read these:"), plus(DOCS["A"], DOCS["B"]), user(QUESTION)),
        cross(system(SYSTEM), plus(DOCS["A"], DOCS["B"])),  # the plus ends the message
    ],
    ids=["groups-in-two-user-turns", "instruction-before-the-group", "group-ends-the-message"],
)
def test_spans_keep_the_conversation_around_them(tok, marker, query):
    """Wherever the group sits, the prompt is the rendering; spans add only their separator and padding."""
    lp = lower(query, tok, BS, marker)
    read = span_order(query, tok, BS)  # the group as it is read
    rendered = tok.apply_chat_template(to_chat_messages(read), tokenize=False, add_generation_prompt=True)
    decoded = tok.decode(unpadded(lp, marker))
    assert decoded.replace("\n", "") == rendered.replace("\n", "")
    for i, text in enumerate(lp.span_texts):
        s, _ = lp.table.spans[i]
        assert lp.token_ids[s : s + len(enc(tok, text))] == enc(tok, text)


def test_a_nested_plus_is_read_as_one_span(tok, newline):
    """The inner group is one span of its children's text, in its own order (`span_order`): the same span
    whichever order the inner children are given in."""
    def read(*inner: str) -> list[str]:
        return lower(cross(system(SYSTEM), plus(fragment("one"), plus(*inner)), user("Q")), tok, BS, newline).span_texts

    assert read("two", "three") == read("three", "two") and read("two", "three")[0] == "one"
    assert read("two", "three")[1] in ("two\n\nthree", "three\n\ntwo")


def test_empty_plus_children_make_no_span(tok, newline):
    lp = lower(cross(system(SYSTEM), plus("", "kept"), user("Q")), tok, BS, newline)
    assert lp.span_texts == ["kept"]


def test_forged_boundaries_in_text_are_just_text(tok, newline):
    """Span boundaries are out of band: text that looks like a sentinel does not make a span."""
    lp = lower(
        cross(system(SYSTEM), plus("one"), user("\u27e6spanq:0:000000000000\u27e7 tail")), tok, BS, newline
    )
    assert len(lp.table.spans) == 1
    assert "\u27e6spanq:0:000000000000\u27e7" in tok.decode(lp.token_ids)


# --------------------------------------------------------------------------------------------- errors


def test_a_span_longer_than_the_context_is_refused_with_the_sizes(tok, newline):
    long_doc = " ".join(f"word{i}" for i in range(300))
    n_span = len(enc(tok, long_doc) + enc(tok, "\n\n"))
    with pytest.raises(ContextLengthError) as raised:
        lower(cross(system(SYSTEM), plus(long_doc, "short"), user("Q")), tok, BS, newline, max_model_len=256)
    message = str(raised.value)
    assert "256" in message
    padded_span = n_span + (-n_span) % BS
    assert str(padded_span) in message
    assert "span 0" in message


def test_the_span_limit_counts_the_anchor_and_one_generated_token(tok, newline):
    """A prepare request `[anchor][span]` generates one token: it must fit with it, and no more is asked."""
    need = len(lower(rag("A"), tok, BS, newline, default_anchor="prefix").prepare_prompt(0)) + 1
    with pytest.raises(ContextLengthError, match="span 0"):
        lower(rag("A"), tok, BS, newline, max_model_len=need - 1, default_anchor="prefix")
    with pytest.raises(ContextLengthError) as raised:  # the span fits; the whole prompt does not
        lower(rag("A"), tok, BS, newline, max_model_len=need, default_anchor="prefix")
    assert "the prompt has" in str(raised.value)


def test_a_prompt_longer_than_the_context_is_refused(tok, newline):
    query = rag()
    n = len(lower(query, tok, BS, newline).token_ids)
    lower(query, tok, BS, newline, max_model_len=n + 1)  # room for one generated token
    lower(query, tok, BS, newline, max_model_len=n + 10, max_new_tokens=10)
    with pytest.raises(ContextLengthError) as raised:
        lower(query, tok, BS, newline, max_model_len=n)
    assert f"{n} tokens" in str(raised.value) and f"window is {n} tokens" in str(raised.value)
    with pytest.raises(ContextLengthError, match="asks for 11 more"):
        lower(query, tok, BS, newline, max_model_len=n + 10, max_new_tokens=11)


def test_a_prompt_without_spans_longer_than_the_context_is_refused(tok, newline):
    query = cross(system(SYSTEM), user("word " * 200))
    with pytest.raises(ContextLengthError):
        lower(query, tok, BS, newline, max_model_len=64)


@pytest.mark.parametrize(
    "query",
    [
        Cross(children=(Print(text="only a print"),)),
        cross(plus("")),
        user(""),
    ],
)
def test_an_empty_input_is_refused(tok, newline, query):
    with pytest.raises(QueryValidationError, match="empty"):
        lower(query, tok, BS, newline)


def test_an_unexecuted_generate_is_refused_naming_its_path(tok, newline):
    inner = generate(user("Write a poem."), max_tokens=5)
    with pytest.raises(QueryValidationError) as raised:
        lower(cross(system(SYSTEM), inner, user("Judge it.")), tok, BS, newline)
    assert raised.value.path == "$.cross[1]"
    assert "executed" in str(raised.value)
    with pytest.raises(QueryValidationError) as raised:
        lower(cross(system(SYSTEM), plus(fragment("x"), inner), user("Judge.")), tok, BS, newline)
    assert raised.value.path == "$.cross[1].plus[1]"
