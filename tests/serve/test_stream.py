"""TextStream and IncrementalDecoder: the streamed deltas add up to the final text, never show half a
character (the decoder holds it), and never show any part of a stop string (the stream holds it)."""

from moeserve.serve.stream import TextStream
from moeserve.tokenizer import ByteTokenizer, IncrementalDecoder

TOK = ByteTokenizer()


def deltas(text: str, stop: list[str]) -> tuple[list[str], TextStream]:
    """One byte token at a time through the decoder, then its text delta into the stream."""
    decoder, s = IncrementalDecoder(TOK), TextStream(stop)
    return [s.push(decoder.push(b)) for b in text.encode("utf-8")], s


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


def test_incremental_decoder_deltas_add_up_to_decode():
    text = "a\u00e9\u20ac\U0001f600 b\u00df\u4e2d\U00010348!"  # ASCII, 2-, 3- and 4-byte characters
    ids = TOK.encode(text)
    assert {len(c.encode("utf-8")) for c in text} == {1, 2, 3, 4}
    decoder = IncrementalDecoder(TOK)
    out = [decoder.push(i) for i in ids]
    assert all("\ufffd" not in d for d in out)  # never half a character
    assert sum(d != "" for d in out) == len(text)  # each character given out once, when its last byte arrives
    assert decoder.flush() == ""
    assert "".join(out) == decoder.text == TOK.decode(ids) == text

    cut = IncrementalDecoder(TOK)
    held = [cut.push(i) for i in TOK.encode("a\u20ac")[:-1]]  # the euro sign cut after 2 of its 3 bytes
    assert held == ["a", "", ""]
    assert cut.flush() == "\ufffd"
    assert cut.text == TOK.decode(TOK.encode("a\u20ac")[:-1]) == "a\ufffd"
