"""The output processor and IncrementalDecoder: the streamed text adds up to the final text, never shows half a
character (the decoder holds it), and never shows any part of a stop string (the processor holds it); tokens whose
text is held ride with the next event, and the last event carries the finish reason."""

from moeserve.runtime.output import OutputProcessor, StreamEvent
from moeserve.runtime.sampling import SamplingParams
from moeserve.tokenizer import ByteTokenizer, IncrementalDecoder

TOK = ByteTokenizer()


def deltas(text: str, stop: list[str]) -> tuple[list[str], OutputProcessor, list[StreamEvent]]:
    """One byte token at a time through the processor, until it ends: the text each token makes final."""
    events: list[StreamEvent] = []
    out = OutputProcessor(TOK, None, SamplingParams(max_new_tokens=100, stop=stop), 1, 100, on_event=events.append)
    got = []
    for b in text.encode("utf-8"):
        seen = len(events)
        out.accept(b, None)
        got.append("".join(e.text for e in events[seen:]))
        if out.done:
            break
    return got, out, events


def ended(out: OutputProcessor, events: list[StreamEvent]) -> str:
    """The text that ending the sequence by its length adds (what was still held)."""
    seen = len(events)
    out.finish("length")
    assert events[-1].finish_reason == "length" and len(events) == seen + 1
    return events[-1].text


def test_multibyte_character_is_held_until_complete():
    out, p, events = deltas("a€b", [])
    assert out == ["a", "", "", "€", "b"]  # € is 3 bytes: nothing until the last one
    assert [e.token_ids for e in events] == [[97], [0xE2, 0x82, 0xAC], [98]]  # held tokens ride with the next text
    assert ended(p, events) == "" and p.completion().text == "a€b"


def test_stop_prefix_is_held_and_stop_never_sent():
    out, p, events = deltas("x = 1\nEND", ["\nEND"])
    assert "".join(out) == "x = 1"
    assert out[-4:] == ["", "", "", ""]  # "\n", "E", "N" held as a possible stop; "D" completes it
    assert (p.finish_reason, events[-1].finish_reason) == ("stop", "stop")  # it ends generation, not only the text
    assert p.completion().text == "x = 1" and len(p.token_ids) == len("x = 1\nEND")


def test_held_prefix_released_when_it_turns_out_not_to_be_a_stop():
    out, p, events = deltas("a\nEx", ["\nEND"])
    assert out == ["a", "", "", "\nEx"]
    assert ended(p, events) == "" and p.completion().text == "a\nEx"


def test_finish_sends_what_is_still_held():
    out, p, events = deltas("ab\nE", ["\nEND"])
    assert "".join(out) == "ab"
    assert ended(p, events) == "\nE"  # generation ended (length) with a stop prefix: it is text after all
    assert p.completion().text == "ab\nE"


def test_earliest_of_several_stops_wins():
    out, p, _ = deltas("one;two.", [".", ";"])
    assert "".join(out) == "one" == p.completion().text and p.finish_reason == "stop"


def test_the_token_budget_and_the_end_of_sequence_token_end_it():
    events: list[StreamEvent] = []
    p = OutputProcessor(TOK, 0, SamplingParams(max_new_tokens=3), 1, 3, on_event=events.append)
    assert [p.accept(t, None) for t in b"abc"] == [None, None, "length"]
    assert (p.completion().text, p.completion().token_ids) == ("abc", list(b"abc"))
    eos = OutputProcessor(TOK, 0, SamplingParams(max_new_tokens=3), 1, 3)
    assert (eos.accept(97, None), eos.accept(0, None)) == (None, "stop")
    assert eos.token_ids == [97]  # the end-of-sequence token is not part of the answer


def test_byte_decode_drops_special_ids_and_replaces_a_cut_character():
    """Ids that are all bytes, and ids with the special ones (which carry no text) among them."""
    euro = TOK.encode("\u20ac")
    assert TOK.decode(euro) == "\u20ac" and TOK.decode([]) == ""
    assert TOK.decode([TOK.bos_id, *euro, TOK.eos_id, TOK.pad_id]) == "\u20ac"
    assert TOK.decode([*euro[:2], TOK.eos_id]) == TOK.decode(euro[:2]) == "\ufffd"
    assert TOK.decode([-1, 104, 10**6, 105]) == "hi"  # out of the vocabulary: no text either


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
