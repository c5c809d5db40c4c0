"""TextStream: the streamed deltas add up to the final text, never show half a character, and never
show any part of a stop string."""

from moeserve.serve.stream import TextStream
from moeserve.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def deltas(text: str, stop: list[str]) -> list[str]:
    s = TextStream(TOK.decode, stop)
    return [s.push(b) for b in text.encode("utf-8")], s


def test_multibyte_character_is_held_until_complete():
    out, s = deltas("a€b", [])
    assert out == ["a", "", "", "€", "b"]  # € is 3 bytes: nothing until the last one
    assert s.finish("a€b") == ""


def test_stop_prefix_is_held_and_stop_never_sent():
    out, s = deltas("x = 1\nEND", ["\nEND"])
    assert "".join(out) == "x = 1"
    assert out[-4:] == ["", "", "", ""]  # "\n", "E", "N" held as a possible stop; "D" completes it
    assert s.finish("x = 1") == ""


def test_held_prefix_released_when_it_turns_out_not_to_be_a_stop():
    out, s = deltas("a\nEx", ["\nEND"])
    assert out == ["a", "", "", "\nEx"]
    assert s.finish("a\nEx") == ""


def test_finish_sends_what_is_still_held():
    out, s = deltas("ab\nE", ["\nEND"])
    assert "".join(out) == "ab"
    assert s.finish("ab\nE") == "\nE"  # generation ended (length) with a stop prefix: it is text after all


def test_earliest_of_several_stops_wins():
    out, s = deltas("one;two.", [".", ";"])
    assert "".join(out) == "one"
