"""What a client sees of generated ids: end-of-turn dropped, stop strings cut, streamed deltas never retracted."""

from __future__ import annotations

from moeflow.serve.text import TextAssembler


def decode(ids: list[int]) -> str:  # a byte-level vocabulary, as the embedded model's
    return bytes(ids).decode("utf-8", errors="replace")


def stream(assembler: TextAssembler, ids: list[int]) -> list[str]:
    deltas = [assembler.delta(ids[: i + 1], final=False) for i in range(len(ids))]
    return deltas + [assembler.delta(ids, final=True)]


def test_multibyte_characters_wait_for_their_last_byte():
    ids = list("é!".encode())
    deltas = stream(TextAssembler(decode, [], set()), ids)
    assert deltas[0] == "" and "".join(deltas) == "é!"


def test_stop_string_across_tokens_is_held_then_cut():
    ids = list(b"abc END more")
    a = TextAssembler(decode, ["END"], set())
    deltas = stream(a, ids)
    assert "".join(deltas) == "abc "
    assert all("E" not in d for d in deltas)  # "E", "EN" were held back, never sent and taken back
    assert a.hits_stop_string(ids) and not a.hits_stop_string(list(b"abc EN"))


def test_held_prefix_is_released_when_it_is_not_a_stop():
    ids = list(b"xENy")
    assert "".join(stream(TextAssembler(decode, ["END"], set()), ids)) == "xENy"


def test_final_end_of_turn_token_is_not_text():
    a = TextAssembler(decode, [], {3})
    assert a.text([104, 105, 3]) == "hi"
    assert a.text([3, 104]) == "\x03h"  # only a final one ends the turn
