"""IncrementalText against the tokenizer's own decode of the whole list, at every length: the shipped Qwen3.5-style
byte-level tokenizer (token sequences that split multi-byte characters, special tokens left out) and a
SentencePiece-style one built with the `tokenizers` library (its decoder drops the space of the first word, so a
window's text is not a slice of the whole's). And what it costs: the tokens decoded per call stay bounded while
a whole-list decode would grow with the answer."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.incremental_text import CONTEXT, SETTLE_EVERY, IncrementalText
from npuport.runtime.serving.api_answers import StreamedText

TEXT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "Größe, café, naïve - 東京で 3 個のりんご 🍎🍏 を買った。 Ünïcödé ÿ 42 + 17 = 59.\n\n")


@pytest.fixture(scope="module")
def byte_level():
    return AutoTokenizer.from_pretrained(trained_tiny_path())


@pytest.fixture(scope="module")
def sentencepiece_like() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT] * 4, trainer=trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"],
                                                                    show_progress=False))
    return tok


def token_lists(vocab_size: int, encoded: list[int]) -> list[list[int]]:
    rng = random.Random(0)
    return [encoded * 3, [rng.randrange(vocab_size) for _ in range(400)]]


def assert_every_length_decodes_as_whole(decode, tokens: list[int]) -> None:
    text = IncrementalText(decode)
    for n in range(len(tokens) + 1):
        assert text.text(tokens[:n]) == decode(tokens[:n]), n


def test_byte_level_text_equals_the_whole_decode_at_every_length(byte_level):
    def decode(tokens):
        return byte_level.decode(list(tokens), skip_special_tokens=True)

    for tokens in token_lists(len(byte_level), byte_level.encode(TEXT)):
        assert_every_length_decodes_as_whole(decode, tokens)


def test_sentencepiece_like_text_equals_the_whole_decode_at_every_length(sentencepiece_like):
    ids = sentencepiece_like.encode("sold clips").ids
    assert sentencepiece_like.decode(ids) == "sold clips"
    assert not sentencepiece_like.decode(ids[1:]).startswith(" ")  # a window's first word loses its space
    for tokens in token_lists(sentencepiece_like.get_vocab_size(), sentencepiece_like.encode(TEXT).ids):
        assert_every_length_decodes_as_whole(sentencepiece_like.decode, tokens)


def test_a_shorter_list_starts_again(byte_level):
    tokens = byte_level.encode(TEXT * 2)
    text = IncrementalText(byte_level.decode)
    text.text(tokens)
    assert text.text(tokens[:5]) == byte_level.decode(tokens[:5])


def test_tokens_decoded_per_call_stay_bounded_as_the_answer_grows(byte_level):
    tokens = byte_level.encode(TEXT * 20)
    decoded: list[int] = []

    def decode(ids):
        decoded.append(len(ids))
        return byte_level.decode(list(ids), skip_special_tokens=True)

    text = IncrementalText(decode)
    for n in range(1, len(tokens) + 1):
        text.text(tokens[:n])
    assert len(tokens) > 1000
    assert max(decoded) <= 2 * (2 * CONTEXT + SETTLE_EVERY), max(decoded)  # a character split: settled later
    assert sum(decoded) < 40 * len(tokens)  # a whole decode per call: len(tokens)^2 / 2


def test_a_stream_with_a_stop_string_and_min_tokens_sends_what_the_answer_keeps(byte_level):
    """StreamedText on its incremental text: the stop string inside the first min_tokens tokens' text does not
    count, the next one does, and the chunks add up to the text before it."""
    tokens = byte_level.encode(TEXT * 3)
    stop = "clips"

    def decode(ids):
        return byte_level.decode(list(ids), skip_special_tokens=True)
    min_tokens = next(n for n in range(len(tokens)) if stop in decode(tokens[:n]))
    whole = decode(tokens)
    second = whole.index(stop, whole.index(stop) + 1)
    streamed = StreamedText(decode, [stop], min_tokens=min_tokens)
    sent = "".join(streamed.add([t]) for t in tokens)
    assert sent == whole[:second]
