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


def test_a_stop_token_ids_text_is_left_out_whole_with_a_sentencepiece_vocab():
    """A stop token id ends the request without its text: the text the token added in the
    stream, which with a SentencePiece vocab has the word's leading space ("▁world" adds
    " world"), though the token decoded alone has none."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.engine.sampling import SamplingParams
    from pdserve.model.tokenizer import TextStream
    from pdserve.v1 import common_pb2
    from services.router.http.choices import ChoiceJob, Token, _one
    from services.router.route_types import TokenOut
    from tests.test_text_stream import _sentencepiece_like

    tok = _sentencepiece_like()
    ids = [tok.token_id(t) for t in ("▁Hello", "▁world", ".")]
    stop_id = ids[1]

    async def generate(*args):
        stream = TextStream(tok)
        for i, t in enumerate(ids[:ids.index(stop_id) + 1]):
            finish = common_pb2.FINISH_REASON_STOP if t == stop_id else 0
            yield TokenOut(t, stream.push(t) + (stream.flush() if finish else ""), 0.0, i, finish)
        yield SimpleNamespace(finish_reason=common_pb2.FINISH_REASON_STOP)

    async def texts():
        router = SimpleNamespace(tokenizer=tok, generate=generate)
        job = ChoiceJob(0, "r", [1], SamplingParams(stop_token_ids=(stop_id,)), ())
        return [ev.text async for ev in _one(router, job) if isinstance(ev, Token)]

    got = asyncio.run(texts())
    assert "".join(got) == tok.decode(ids[:ids.index(stop_id)]) == "Hello"
