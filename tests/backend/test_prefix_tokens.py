"""`PrefixTokens` (docs/design.md, "Read in context again"): a prompt over documents read in context before, in the
same order, tokenizes only what follows them — and its ids are exactly the whole prompt's tokenization."""

from __future__ import annotations

import copy

import pytest

from spanq_backend.serving import prefix_tokens
from spanq_backend.serving.generator import load_chat_tokenizer
from spanq_backend.serving.prefix_tokens import PrefixTokens, cut_before, documents_end, splits_words


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_chat_tokenizer(tiny_model)


DOCS = ["Card A. The ferry leaves at nine; tickets cost 4.50 each.",
        "Card B. Lanterns line the harbor wall from dusk, 1887–1901!",
        "Card C. 北の市場 opens at dawn (weekdays only)."]


def prompt(question: str) -> str:
    return ("<|im_start|>system\nAnswer from the cards.<|im_end|>\n<|im_start|>user\n" + "\n\n".join(DOCS)
            + question + "<|im_end|>\n<|im_start|>assistant\n")


# What comes after the documents: a new question, starting with what may join the documents' last word when it is
# read alone (no space, punctuation, digits, newlines, another script).
QUESTIONS = ["\n\nWhich card names a harbor?", "Which card?", "!!?", "1901 or 1887?", " and the market?",
             "\n", "市場はどこ?", "'s ferry: when?", ""]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_a_prompt_over_documents_kept_tokenizes_as_the_whole_prompt_does(tokenizer):
    kept = PrefixTokens(tokenizer)
    first = prompt(QUESTIONS[0])
    end = documents_end(first, DOCS)
    assert kept.learn(first, end, encode(tokenizer, first))
    for question in QUESTIONS:
        text = prompt(question)
        assert documents_end(text, DOCS) == end
        assert kept.ids(text, end) == encode(tokenizer, text), question
    assert kept.hits == len(QUESTIONS) and kept.refused == 0
    # Another text before the end of the documents (another instruction, another order) finds nothing kept.
    assert kept.ids(prompt("?").replace("Answer from", "Answer using"), end) is None


def test_the_check_can_fail_a_cut_inside_a_word_is_refused(tokenizer, monkeypatch):
    """A cut that does not tokenize as the whole (inside a word, where the tokenizer merges across it) is found
    when it is learned, and nothing is kept: the prompt is tokenized whole again."""
    first = prompt(QUESTIONS[0])
    end = documents_end(first, DOCS)
    inside = first.index("wall") + 2  # "wa|ll"
    monkeypatch.setattr(prefix_tokens, "cut_before", lambda text, end: inside)
    kept = PrefixTokens(tokenizer)
    assert not kept.learn(first, end, encode(tokenizer, first))
    assert kept.refused == 1 and kept.ids(prompt("Which card?"), end) is None
    # ... where, kept unchecked, its ids would not be the prompt's.
    head = encode(tokenizer, first[:inside])
    assert head + encode(tokenizer, prompt("Which card?")[inside:]) != encode(tokenizer, prompt("Which card?"))


def test_a_cut_lies_between_words_well_before_the_documents_end():
    text = "alpha beta gamma " + "x" * 40 + " delta epsilon"
    end = len(text)
    cut = cut_before(text, end)
    assert cut == text.index(" " + "x" * 40) and end - cut >= prefix_tokens.MARGIN
    assert cut_before("one word", 8) is None  # nothing that far before the end
    assert cut_before("a  " + "b" * 40, 43) is None  # two spaces: not a space between two words


def test_a_tokenizer_that_does_not_split_words_first_keeps_nothing(tokenizer):
    from tokenizers import pre_tokenizers

    whole = copy.deepcopy(tokenizer)
    whole.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([])  # merges over the whole text
    assert splits_words(tokenizer) and not splits_words(whole)
    kept = PrefixTokens(whole)
    first = prompt(QUESTIONS[0])
    assert not kept.learn(first, documents_end(first, DOCS), encode(whole, first))
    assert kept.ids(first, documents_end(first, DOCS)) is None


def test_kept_prefixes_are_bounded(tokenizer, monkeypatch):
    monkeypatch.setattr(PrefixTokens, "CAPACITY", 2)
    kept = PrefixTokens(tokenizer)
    texts = [prompt("?").replace("Card A.", f"Card A{i}.") for i in range(3)]
    ends = [t.index("<|im_end|>\n<|im_start|>assistant") - 1 for t in texts]
    for t, e in zip(texts, ends):
        assert kept.learn(t, e, encode(tokenizer, t))
    assert kept.ids(texts[0], ends[0]) is None  # the least recently used went
    assert kept.ids(texts[2], ends[2]) == encode(tokenizer, texts[2])
