"""TextStream (incremental detokenization) against the tokenizer's full decode: the pieces a
stream hands out, joined, are always a prefix of the full text and, once flushed, exactly it.
Byte-level (the built-in vocab) and a Llama-style SentencePiece vocab with byte fallback, where
decoding from the middle of a sequence differs from decoding it whole (the leading-space rule)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from pdserve.model.tokenizer import TextStream, Tokenizer


def _sentencepiece_like() -> Tokenizer:
    """A Llama-style vocab: <unk> <s> </s>, the 256 byte-fallback tokens, then word pieces."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for word in ["▁", "▁Hello", "▁world", "Hello", ",", ".", "▁the", "▁a", "ing", "▁run", "er", "▁▁", "é", "▁日本"]:
        vocab[word] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(tok)


def _utf8_ids(tok: Tokenizer, rng: random.Random, n: int, stray: list[int], anywhere: bool) -> list[int]:
    """Ids that spell multi-byte text, with a few `stray` ids: anywhere, or between characters."""
    texts = ["".join(rng.choice("ab é日本語😀,. ") for _ in range(rng.randint(1, n))) for _ in range(4)]
    if anywhere:
        ids = tok.encode("".join(texts), add_special_tokens=False)
        for _ in range(rng.randint(0, 3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(stray))
        return ids
    return [i for t in texts for i in (*tok.encode(t, add_special_tokens=False), *rng.sample(stray, rng.randint(0, 1)))]


@pytest.mark.parametrize("make", [Tokenizer.byte_level, _sentencepiece_like], ids=["byte_level", "sentencepiece"])
def test_pieces_join_to_the_full_decode(make):
    """For the byte-level vocab, stray ids anywhere, bytes that are not UTF-8 included. With byte
    fallback, a character cut by a stray id decodes differently in a prefix than in the whole
    (U+FFFD for another span of bytes; the library's full decode did so as much as the stream),
    so there the strays (special tokens, word pieces) fall between characters."""
    tok = make()
    rng = random.Random(7)
    byte_level = make is Tokenizer.byte_level
    stray = list(range(tok.vocab_size)) if byte_level else [0, 1, 2, *range(259, tok.vocab_size)]
    sequences = [_utf8_ids(tok, rng, 20, stray, byte_level) for _ in range(300)]
    sequences += [[rng.choice(stray) for _ in range(rng.randint(1, 40))] for _ in range(150)]
    for ids in sequences:
        full = tok.decode(ids)
        stream, got = TextStream(tok), ""
        for i in ids:
            got += stream.push(i)
            assert full.startswith(got), (ids, got, full)
        got += stream.flush()
        assert got == full, ids
        assert stream.flush() == ""


def test_incomplete_characters_are_held_back_until_they_complete():
    tok = Tokenizer.byte_level()
    stream = TextStream(tok)
    first, second, third = "日".encode()
    assert [stream.push(b) for b in (*b"a", first, second)] == ["a", "", ""]
    assert stream.push(third) == "日"
    assert stream.push(first) == ""
    assert stream.flush() == "\ufffd"  # the stream ended mid-character

