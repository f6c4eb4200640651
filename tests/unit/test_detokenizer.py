"""The incremental detokenizer over a byte-per-token vocabulary: text comes out a whole character at a
time, and an output that ends inside a character ends in U+FFFD, as a decode of its tokens does."""

import pytest

from goodput_runtime.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token i is byte i; decoding replaces incomplete or invalid UTF-8 with U+FFFD, as transformers' does."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "añ€😀b"  # one-, two-, three- and four-byte characters
PROMPT = list(b"Say: ")


def run(tokens, stop=(), flush=True):
    detok = IncrementalDetokenizer(ByteTokenizer(), PROMPT, stop)
    pieces = []
    stopped = False
    for t in tokens:
        stopped = detok.add(t)
        pieces.append(detok.delta(False))
        if stopped:
            break
    if flush and not stopped:
        stopped = detok.flush()
    pieces.append(detok.delta(True))
    return pieces, stopped


@pytest.mark.parametrize("cut", range(1, len(TEXT.encode()) + 1))
def test_every_cut_gives_the_decode_of_the_tokens_and_streams_the_same(cut):
    tokens = list(TEXT.encode())[:cut]
    pieces, _ = run(tokens)
    assert "".join(pieces) == bytes(tokens).decode("utf-8", errors="replace")
    assert all("\ufffd" not in p for p in pieces[:-1])  # never a replacement mid-stream for a character that completes


def test_a_character_is_held_until_its_last_byte_arrives():
    detok = IncrementalDetokenizer(ByteTokenizer(), PROMPT, ())
    euro = list("€".encode())
    for byte in euro[:-1]:
        detok.add(byte)
        assert detok.delta(False) == ""
    detok.add(euro[-1])
    assert detok.delta(False) == "€"


def test_without_the_flush_the_partial_character_would_be_lost():
    tokens = list("a€".encode())[:-1]
    pieces, _ = run(tokens, flush=False)
    assert "".join(pieces) == "a"
    pieces, _ = run(tokens)
    assert "".join(pieces) == "a\ufffd"


def test_nothing_after_a_stop_string_is_flushed():
    tokens = [*b"ab STOP", *"€".encode()[:2]]
    pieces, stopped = run(tokens, stop=("STOP",))
    assert stopped and "".join(pieces) == "ab "


def test_a_flushed_replacement_can_complete_a_stop_string():
    detok = IncrementalDetokenizer(ByteTokenizer(), PROMPT, ("x\ufffd",))
    for t in [*b"ax", 0xE2]:
        assert not detok.add(t)
    assert detok.flush()
    assert detok.delta(True) == "a"
