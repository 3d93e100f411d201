"""Stop strings over text pieces (unit: the router's matcher, no processes)."""

from __future__ import annotations

from services.router.stop_strings import StopStrings


def feed(stops, pieces):
    s = StopStrings(tuple(stops))
    out = []
    for p in pieces:
        text, hit = s.push(p)
        out.append(text)
        if hit:
            return out, True
    return out + [s.flush()], False


def test_a_stop_that_ends_inside_a_token_releases_only_what_precedes_it():
    assert feed(["ell"], ["h", "ello world"]) == (["h", ""], True)
    assert feed(["lo w"], ["hel", "lo", " wor", "ld"]) == (["he", "l", ""], True)


def test_text_that_might_start_a_stop_is_held_until_it_cannot():
    assert feed(["abc"], ["xa", "b", "d", "e"]) == (["x", "", "abd", "e", ""], False)
    assert feed(["abc"], ["xa", "b"]) == (["x", "", "ab"], False)  # flushed at the end
    assert feed(["ab", "bcd"], ["xb", "c", "a", "b"]) == (["x", "", "bc", ""], True)


def test_the_earliest_stop_wins_and_empty_stops_are_ignored():
    assert feed(["", "cd", "bcde"], ["abcdef"]) == (["a"], True)
    assert feed(["cd", "bcdx"], ["abcdef"]) == (["ab"], True)
    assert feed([], ["abc"]) == (["abc", ""], False)
