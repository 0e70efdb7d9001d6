"""The incremental Detokenizer: streamed pieces add up to the text of a full decode, cut at stop strings."""
import pytest

from conftest import char_tokenizer
from loramux.engine.detokenizer import Detokenizer
from loramux.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(char_tokenizer())


def feed(detokenizer, ids, chunk=1):
    pieces, stopped = [], False
    for i in range(0, len(ids), chunk):
        final = i + chunk >= len(ids)
        delta, hit = detokenizer.update(ids[i:i + chunk], final)
        pieces.append(delta)
        stopped = stopped or hit
        if hit:
            break
    return pieces, stopped


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_pieces_add_up_to_a_full_decode(tokenizer, chunk):
    ids = tokenizer.encode("The quick brown fox, 42 times!")
    pieces, stopped = feed(Detokenizer(tokenizer), ids, chunk)
    assert "".join(pieces) == tokenizer.decode(ids) and not stopped


@pytest.mark.parametrize("stop, expected", [(("fox",), "The quick brown "), (("q", "brown"), "The "),
                                             (("xyz",), "The quick brown fox jumps"), (("s",), "The quick brown fox jump")])
def test_stop_strings_cut_the_text_and_are_held_back_while_they_may_start(tokenizer, stop, expected):
    ids = tokenizer.encode("The quick brown fox jumps")
    detokenizer = Detokenizer(tokenizer, stop)
    pieces, stopped = feed(detokenizer, ids)
    assert "".join(pieces) == expected == detokenizer.text and stopped == (expected != "The quick brown fox jumps")
    for piece_end in range(1, len(pieces)):  # nothing released ever ends in a partial match that later completed
        released = "".join(pieces[:piece_end])
        assert not any(s in released for s in stop)


def test_nothing_is_released_after_a_stop(tokenizer):
    detokenizer = Detokenizer(tokenizer, ("b",))
    assert detokenizer.update(tokenizer.encode("ab"), False) == ("a", True)
    assert detokenizer.update(tokenizer.encode("cd"), True) == ("", False)  # late tokens of an aborted request
    assert detokenizer.text == "a"


def test_stop_strings_count_from_min_tokens_on(tokenizer):
    ids = tokenizer.encode("ab. cd. ef.")
    assert "".join(feed(Detokenizer(tokenizer, (".",)), ids)[0]) == "ab"
    pieces, stopped = feed(Detokenizer(tokenizer, (".",), min_tokens=4), ids)
    assert "".join(pieces) == "ab. cd" and stopped  # the first "." came before the 4th token
    # a stop string that ends in the min_tokens-th token's text counts, though it began before (as vLLM)
    pieces, stopped = feed(Detokenizer(tokenizer, ("##",), min_tokens=4), tokenizer.encode("Hi##there"))
    assert "".join(pieces) == "Hi" and stopped
