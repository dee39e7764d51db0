"""Stop strings on streamed text: held-back prefixes, matches across feeds, and agreement with
cutting the whole text, however it is split."""

import random

import pytest

from candelabra.core.engine.stop_strings import StopStringMatcher


def run(stop, feeds, finish=True):
    """Everything emitted, per feed (and finish), and the matcher."""
    matcher = StopStringMatcher(stop)
    emitted = []
    for text in feeds:
        piece, stopped = matcher.feed(text)
        emitted.append(piece)
        assert stopped == matcher.stopped
    if finish:
        emitted.append(matcher.finish())
    return emitted, matcher


def test_a_stop_string_split_across_feeds_is_found_and_never_emitted():
    emitted, matcher = run(["</answer>"], ["The answer is 42</", "ans", "wer> and more"])
    assert emitted == ["The answer is 42", "", "", ""]
    assert matcher.matched == "</answer>" and matcher.stopped


def test_a_possible_beginning_is_held_back_then_released_when_it_does_not_match():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("RY") == ("STORY", False)
    assert matcher.feed(" S") == (" ", False)
    assert matcher.feed("STOP!") == ("S", True)
    assert matcher.matched == "STOP"


def test_the_stop_string_completing_first_wins():
    emitted, matcher = run(["ab", "abc"], ["a", "b", "c"])
    assert "".join(emitted) == "" and matcher.matched == "ab"
    emitted, matcher = run(["abc", "ab"], ["xabc"])
    assert emitted == ["x", ""] and matcher.matched == "ab"
    emitted, matcher = run(["bc", "abcd"], ["abcd"])
    assert emitted == ["a", ""] and matcher.matched == "bc"


def test_of_stop_strings_completing_together_the_longer_wins():
    emitted, matcher = run(["c", "bc"], ["ab", "c"])
    assert emitted == ["a", "", ""] and matcher.matched == "bc"


def test_among_several_stop_strings_near_misses_are_released_and_a_full_match_stops():
    stop = ["\n\n", "User:", "###"]
    emitted, matcher = run(stop, ["Sure.", " Here", " it is #", "# not yet", "\nUser", ":", " hi"])
    assert "".join(emitted) == "Sure. Here it is ## not yet\n" and matcher.matched == "User:"


def test_a_stop_string_at_the_very_start():
    emitted, matcher = run(["Hello"], ["Hello world"])
    assert emitted == ["", ""] and matcher.matched == "Hello"


def test_finish_releases_held_text():
    emitted, matcher = run(["<|end|>"], ["done <|e", "n"], finish=False)
    assert emitted == ["done ", ""]
    assert matcher.finish() == "<|en"
    assert matcher.finish() == "" and matcher.matched is None and not matcher.stopped


def test_nothing_is_emitted_after_a_stop():
    matcher = StopStringMatcher(["x"])
    assert matcher.feed("axb") == ("a", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.finish() == ""


def test_a_repeated_beginning_inside_a_stop_string_is_tracked():
    emitted, matcher = run(["aab"], ["a", "a", "a", "a", "b", "z"])
    assert "".join(emitted) == "aa" and matcher.matched == "aab"
    emitted, matcher = run(["abab"], ["aba", "bab"])
    assert "".join(emitted) == "" and matcher.matched == "abab"


@pytest.mark.parametrize("stop", [[], [""], ["", ""]])
def test_no_stop_strings_pass_everything_through(stop):
    matcher = StopStringMatcher(stop)
    assert matcher.feed("anything at all") == ("anything at all", False)
    assert matcher.feed("") == ("", False)
    assert matcher.finish() == ""


def test_empty_stop_strings_are_ignored_among_others():
    emitted, matcher = run(["", "end"], ["the e", "nd"])
    assert emitted == ["the ", "", ""] and matcher.matched == "end"


def first_stop(text, stop):
    """The text up to the stop string that completes first (the longer on a tie), and it."""
    for end in range(1, len(text) + 1):
        completed = [s for s in stop if s and text[:end].endswith(s)]
        if completed:
            matched = max(completed, key=len)
            return text[:end - len(matched)], matched
    return text, None


def random_split(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(len(text) - 1, 8) + 1))) if text else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_random_texts_and_splits_agree_with_cutting_the_whole_text():
    rng = random.Random(2024)
    alphabet = "ab\n😀"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 20)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5))) for _ in range(rng.randrange(0, 4))]
        expected, matched = first_stop(text, stop)
        feeds = random_split(rng, text)
        emitted, matcher = run(stop, feeds)
        assert "".join(emitted) == expected, (text, stop, feeds)
        assert matcher.matched == matched
        stopped_at = next((i for i in range(len(feeds)) if first_stop("".join(feeds[:i + 1]), stop)[1]), None)
        if stopped_at is not None:
            assert not any(emitted[stopped_at + 1:])
