"""The one check of a text and of token ids, and the one bits per byte: what the server, the engine, the step
engine and batch scoring all refuse or report."""

from __future__ import annotations

import math

import pytest

from moeserve.errors import UserError
from moeserve.runtime.sampling import EngineError
from moeserve.runtime.scores import bits_per_byte
from moeserve.runtime.validate import check_text, check_token_ids, check_unicode


def test_a_text_is_a_non_empty_string_of_valid_unicode():
    assert check_text("héllo", "prompt") == "héllo"
    for bad, message in ((5, "prompt must be a string, got int"), (None, "prompt must be a string, got NoneType"),
                         ("", "prompt is empty"),
                         ("a\ud800b", "prompt is not valid Unicode: a lone surrogate U+D800 at character 1")):
        with pytest.raises(EngineError) as e:
            check_text(bad, "prompt")
        assert str(e.value) == message and isinstance(e.value, UserError)


def test_unicode_alone_lets_an_empty_string_pass():
    check_unicode("", "messages[0].content")
    with pytest.raises(EngineError, match=r"stop is not valid Unicode: a lone surrogate U\+DC00 at character 0"):
        check_unicode("\udc00", "stop")


@pytest.mark.parametrize("ids", [[1, 10], [1, -1], [True], [1.0]])
def test_token_ids_outside_the_vocabulary_are_refused(ids):
    with pytest.raises(EngineError, match=r"^prompt 2 has a token id outside \[0, 10\)$"):
        check_token_ids(ids, 10, "prompt 2")


def test_token_ids_inside_the_vocabulary_pass():
    check_token_ids([0, 9, 5], 10)
    check_token_ids([], 10)  # no ids is for the caller to refuse, with its own words


def test_bits_per_byte_counts_utf8_bytes_not_characters():
    assert bits_per_byte(-math.log(2) * 6, "abc") == pytest.approx(2.0)
    assert bits_per_byte(-math.log(2) * 6, "é") == pytest.approx(3.0)  # two bytes
