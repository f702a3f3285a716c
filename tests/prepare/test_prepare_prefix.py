"""Bounded-prefix tokenization: ``prefix_ids(text, n) == encode(text)[:n]``."""

from __future__ import annotations

import dataclasses
import json
import random
import unicodedata
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from meshkit import Mesh
from meshkit.errors import InvalidRequest
from meshkit.prepare import tokenizers as tokenizers_module
from meshkit.prepare.tokenizers import (
    BYTES_PER_TOKEN,
    CUT_WHITESPACE,
    DENSITY_RANGE,
    LoadedTokenizer,
    TokenizerSpec,
    appendable,
    classify,
    punct_symbol_codepoints,
    unstable_alnum_codepoints,
)

# -- the unicode facts the safe-cut argument rests on --------------------------------


def _composition_seconds() -> set[str]:
    seconds = set()
    for cp in range(0x110000):
        decomposition = unicodedata.decomposition(chr(cp))
        if decomposition and not decomposition.startswith("<"):
            parts = decomposition.split()
            if len(parts) == 2:
                seconds.add(chr(int(parts[1], 16)))
    # Hangul syllables compose algorithmically: L+V and LV+T.
    seconds.update(chr(cp) for cp in range(0x1161, 0x1176))
    seconds.update(chr(cp) for cp in range(0x11A8, 0x11C3))
    return seconds


def test_a_cut_character_never_composes_with_what_precedes_it() -> None:
    seconds = _composition_seconds()
    cut_chars = [chr(cp) for cp in punct_symbol_codepoints()] + list(CUT_WHITESPACE)
    assert len(cut_chars) > 5000
    for ch in cut_chars:
        assert unicodedata.combining(ch) == 0, hex(ord(ch))
        assert ch not in seconds, hex(ord(ch))
        normalized = unicodedata.normalize("NFC", ch)
        assert unicodedata.combining(normalized[0]) == 0
        if ch in CUT_WHITESPACE:
            assert normalized == ch
        else:  # still punctuation or a symbol: a letter run stops before it
            assert unicodedata.category(normalized[0])[0] in "PS", hex(ord(ch))


def test_nfc_keeps_what_a_cut_relies_on() -> None:
    unstable = set(unstable_alnum_codepoints())
    assert 0x958 in unstable  # क़ -> क + nukta: never cut after it
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        ch = chr(cp)
        normalized = unicodedata.normalize("NFC", ch)
        # Shape 1: a text ending in non-whitespace still does after NFC.
        if not ch.isspace():
            assert not normalized[-1].isspace(), hex(cp)
        # Shape 2: a letter or digit composing with what precedes it stays one.
        decomposition = unicodedata.decomposition(ch)
        if decomposition and not decomposition.startswith("<"):
            parts = [chr(int(p, 16)) for p in decomposition.split()]
            if len(parts) == 2 and parts[1].isalnum() and normalized == ch:
                assert ch.isalnum(), hex(cp)
    assert "\uac00".isalnum()  # Hangul L+V and LV+T compose into syllables (letters)


def _check_cuts(tok: LoadedTokenizer, text: str, starts: list[int], follow: int = 4) -> None:
    """Stronger than the prefix property: the ids before *any* cut the tokenizer
    picks are exactly the first ids of the whole text (no slack in the count), and
    for an appendable tokenizer the text between two cuts, tokenized alone, has
    exactly the ids the whole text has there (what continuing from a cut needs).

    From each start, the first cut and the ``follow`` cuts after it are checked.
    """
    full = tok.encode(text, add_special_tokens=False)
    heads: dict[int, int] = {0: 0}  # cut -> number of ids before it
    for start in starts:
        cut = tok._find_cut(text, start)
        previous = None
        for _ in range(follow + 1):
            if cut is None:
                break
            assert start <= cut < len(text)
            if cut not in heads:
                head = tok.encode(text[:cut], add_special_tokens=False)
                assert full[: len(head)] == head, (start, cut)
                heads[cut] = len(head)
            if tok._info.appendable:
                for a in (0, previous):
                    if a is not None:
                        piece = tok.encode(text[a:cut], add_special_tokens=False)
                        assert piece == full[heads[a] : heads[cut]], (a, cut)
                rest = tok.encode(text[cut:], add_special_tokens=False)
                assert rest == full[heads[cut] :], cut
            previous = cut
            cut = tok._find_cut(text, cut + 1)


@pytest.fixture(scope="module")
def nukta(tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    """A byte-level BPE that learned to merge a nukta with a following "."."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["\u0958. \u0958.\u0958." * 20, "hello world."] * 20, trainer)
    path = tmp_path_factory.mktemp("nukta") / "tokenizer.json"
    tok.save(str(path))
    return TokenizerSpec(path).load()


def test_no_cut_after_a_letter_nfc_splits(nukta: LoadedTokenizer) -> None:
    # NFC turns क़ (U+0958) into क + nukta, and the nukta joins the "." after it:
    # a cut before the "." would end the text on a lone nukta token.
    assert nukta.cut_mode == "regex"
    text = "\u0958." * 50 + " tail"
    _check_cuts(nukta, text, list(range(len(text))))


# -- classification ---------------------------------------------------------------


def _variant(tiny_dir: Path, tmp_path: Path, **changes: Any) -> LoadedTokenizer:
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    data.update(changes)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    return TokenizerSpec(tmp_path).load()


def test_classification(tiny: LoadedTokenizer, tiny_dir: Path, tmp_path: Path) -> None:
    assert tiny.cut_mode == "regex"
    nfkc = _variant(tiny_dir, tmp_path, normalizer={"type": "NFKC"})
    assert nfkc.cut_mode == "checked"
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert classify(tok) == "whitespace"
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    assert classify(tok) == "checked"
    tok.pre_tokenizer = pre_tokenizers.Split(r"\s+", behavior="isolated")
    assert classify(tok) == "checked"  # a regex the argument does not cover
    tok.pre_tokenizer = None
    assert classify(tok) == "checked"


def test_qwen_is_covered_by_the_proof(qwen: LoadedTokenizer) -> None:
    assert qwen.cut_mode == "regex"
    assert qwen._info.appendable


def test_appendable(tiny: LoadedTokenizer, tiny_dir: Path, tmp_path: Path) -> None:
    assert tiny._info.appendable
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    prefixed = _variant(
        tiny_dir, tmp_path, pre_tokenizer={**data["pre_tokenizer"], "add_prefix_space": True}
    )
    assert prefixed.cut_mode == "regex"  # a prefix of the text is still exact ...
    assert not prefixed._info.appendable  # ... but text after a cut is not alone
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert appendable(tok, classify(tok))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not appendable(tok, classify(tok))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_tokens([AddedToken("<x>", rstrip=True)])
    assert not appendable(tok, "whitespace")


def test_why_a_stripping_added_token_forbids_continuing(tiny_dir: Path, tmp_path: Path) -> None:
    # "<x>" with rstrip absorbs the space after it: cut before that space, the
    # text after the cut tokenized alone has a space token the whole text has not.
    base = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    base.add_tokens([AddedToken("<x>", rstrip=True)])
    base.save(str(tmp_path / "tokenizer.json"))
    tok = TokenizerSpec(tmp_path).load()
    assert tok.cut_mode == "regex"
    assert not tok._info.appendable
    text = "the<x> quick brown fox " * 40
    cut = text.index(" ")
    assert tok._find_cut(text, 4) == cut
    full = tok.encode(text, add_special_tokens=False)
    head = tok.encode(text[:cut], add_special_tokens=False)
    assert full[: len(head)] == head  # the prefix is still exact ...
    assert head + tok.encode(text[cut:], add_special_tokens=False) != full  # ... this not
    for n in (1, 5, 50, 200):
        assert tok.prefix_ids(text, n) == full[:n]
    # Had it continued anyway, it would have been wrong:
    wrong = dataclasses.replace(tok._info, appendable=True)
    tok._info = wrong

    def continued(n: int) -> list[int]:
        tok._density = 1.0  # a short first piece: the rest is continued
        return tok.prefix_ids(text, n)

    assert any(continued(n) != full[:n] for n in range(1, 200))


# -- strategies ---------------------------------------------------------------------

CODE = [
    "def f(x):\n    return x + 1\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "SELECT * FROM t WHERE id=42;",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "if __name__ == '__main__':\n\tmain()\r\n",
    "x=>x**2;//comment",
    '<div class="a">&nbsp;</div>',
]
SPECIAL_FRAGMENTS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<think>",
    "</tool_call>",
    "<|im_",
    "im_start|>",
    "<s>",
    "</s>",
    "<|user|>",
    "<|end|>",
]
WHITESPACE = [
    *(" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", " \t "),
    *("\u3000", "\xa0", "\u2003", "\x0b", "\x0c", "\x1c", "\x85", "\u2028"),
]
TRICKY = [
    # combining marks, Hangul jamo, NFC singletons and composition exclusions
    *("e\u0301", "\u0301", "\u1100\u1161", "\u1161", "\u11a8", "A\u030a", "\u0b47\u0b3e"),
    *("\u037e", "\u212a", "\u1fef", "\u00a8", "\u2126", "\u0958", "\ufb2a"),
    # compatibility characters, invisibles, emoji sequences
    *("ﬁ", "™", "①", "²", "½", "\u200b", "\u200d", "\ufeff"),
    *("\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f1eb\U0001f1f7"),
    # contractions, quotes, punctuation runs, identifiers, numbers
    *("'s", "'LL", "’", "“", "--", "->", "...", "_", "__init__", "1,000.50", "0x1F"),
]

cjk = st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=40)
SURROGATES: tuple[Literal["Cs"]] = ("Cs",)  # (typed: mypy infers a tuple of str)
segment = st.one_of(
    st.text(max_size=30),  # anything, unicode included
    st.from_regex(r"[A-Za-z]{1,12}", fullmatch=True),
    st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz"), min_size=40, max_size=400),
    cjk,
    st.sampled_from(list("，。、！？：；「」")),
    st.sampled_from(CODE),
    st.sampled_from(WHITESPACE),
    st.builds(
        lambda c, k: c * k, st.characters(exclude_categories=SURROGATES), st.integers(1, 300)
    ),
    st.from_regex(r"[0-9]{1,24}", fullmatch=True),
    st.sampled_from(SPECIAL_FRAGMENTS),
    st.sampled_from(TRICKY),
)
short_texts = st.lists(segment, min_size=1, max_size=60).map("".join)
texts = st.builds(
    lambda parts, repeat, tail: ("".join(parts) * repeat)[:20_000] + "".join(tail),
    st.lists(segment, min_size=1, max_size=40),
    st.integers(1, 40),
    st.lists(segment, max_size=10),
)


def prop(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _check(tok: LoadedTokenizer, text: str, n: int) -> None:
    expected = tok.encode(text, add_special_tokens=False)[:n]
    # The aim only sizes the pieces: whatever was learned, and at a very short
    # aim (many continued pieces) and the longest one, the ids are the same.
    for density in (None, 1.0, DENSITY_RANGE[1]):
        if density is not None:
            tok._density = density
        assert tok.prefix_ids(text, n) == expected


# -- the property on the real Qwen tokenizer ---------------------------------------


@pytest.mark.parametrize("n", [1, 16, 256])
@prop(200)
@given(text=texts)
@example(text="word " * 1000)
@example(text="a  b " * 500)
@example(text="x" * 5000)
@example(text="中文" * 3000)
@example(text="中文，" * 3000)
@example(text="hello.\n\n" * 500)
@example(text="<|im_start|>user\nhi<|im_end|>\n" * 300)
@example(text="e\u0301 " * 2000)
def test_prefix_ids_equals_the_full_encode_qwen(qwen: LoadedTokenizer, n: int, text: str) -> None:
    _check(qwen, text, n)


@prop(300)
@given(text=st.one_of(short_texts, texts), data=st.data())
def test_every_cut_is_a_token_boundary_qwen(
    qwen: LoadedTokenizer, text: str, data: st.DataObject
) -> None:
    starts = data.draw(st.lists(st.integers(0, len(text)), min_size=1, max_size=8))
    _check_cuts(qwen, text, starts)


@prop(150)
@given(text=st.one_of(short_texts, texts), data=st.data())
def test_every_cut_is_a_token_boundary_tiny(
    tiny: LoadedTokenizer, text: str, data: st.DataObject
) -> None:
    starts = data.draw(st.lists(st.integers(0, len(text)), min_size=1, max_size=8))
    _check_cuts(tiny, text, starts)


@pytest.mark.parametrize("offset", range(0, 16))
def test_no_cut_inside_a_special_token(qwen: LoadedTokenizer, offset: int) -> None:
    n = 16
    target = n * 8 + 64
    text = "z" * (target - offset) + "<|im_start|>user\nhello world<|im_end|>" + " more" * 400
    _check(qwen, text, n)


def test_the_straddle_check_sees_a_special_token(qwen: LoadedTokenizer) -> None:
    text = "ab<|im_start|>cd"
    cut = text.index("_")  # letter then punctuation: a cut candidate inside the token
    assert qwen._straddles(text, cut)
    assert not qwen._straddles(text, text.index("<"))


# -- the same property on small tokenizers (fast, more examples) ---------------------


@pytest.mark.parametrize("n", [1, 16, 256])
@prop(80)
@given(text=texts)
def test_prefix_ids_equals_the_full_encode_tiny(tiny: LoadedTokenizer, n: int, text: str) -> None:
    _check(tiny, text, n)


@prop(100)
@given(text=texts, n=st.sampled_from([1, 16, 256]))
def test_prefix_ids_with_special_tokens(tiny: LoadedTokenizer, text: str, n: int) -> None:
    expected = tiny.encode(text, add_special_tokens=True)[:n]
    assert expected[0] == tiny.tokenizer.token_to_id("<s>")
    assert tiny.prefix_ids(text, n, add_special_tokens=True) == expected


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    """A SentencePiece-style BPE: not covered by the proof, so results are checked."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "中文测试，这是一个句子。"] * 50
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    )
    path = tmp_path_factory.mktemp("metaspace") / "tokenizer.json"
    tok.save(str(path))
    return TokenizerSpec(path).load()


@pytest.mark.parametrize("n", [1, 16, 256])
@prop(60)
@given(text=texts)
def test_prefix_ids_on_a_checked_tokenizer(metaspace: LoadedTokenizer, n: int, text: str) -> None:
    assert metaspace.cut_mode == "checked"
    _check(metaspace, text, n)


@pytest.mark.parametrize(
    ("text", "has_cut"),
    [
        ("a" * 100_000, False),  # one long word
        ("!" * 100_000, False),  # one long punctuation run
        ("\u0958." * 50_000, False),  # only rejected candidates: gives up after a few
        ("<|im_start|>" * 10_000, False),  # every candidate inside a special token
        ("(! " * 30_000, True),  # whitespace after punctuation, found inside the run
        ("\n \n x" * 30_000, True),
    ],
)
def test_adversarial_texts(qwen: LoadedTokenizer, text: str, has_cut: bool) -> None:
    assert (qwen._find_cut(text, 200) is not None) == has_cut
    _check(qwen, text, 16)


@pytest.fixture(scope="module")
def prefixed(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    """The tiny tokenizer with a prefix space: proven cuts, but no continuing."""
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    data["pre_tokenizer"]["add_prefix_space"] = True
    path = tmp_path_factory.mktemp("prefixed") / "tokenizer.json"
    path.write_text(json.dumps(data))
    return TokenizerSpec(path).load()


@pytest.mark.parametrize("n", [1, 16, 256])
@prop(60)
@given(text=texts)
def test_prefix_ids_without_continuing(prefixed: LoadedTokenizer, n: int, text: str) -> None:
    """A tokenizer that may not continue restarts from 0 with longer cuts: exact too."""
    assert prefixed.cut_mode == "regex"
    assert not prefixed._info.appendable
    _check(prefixed, text, n)


def _reads(tok: LoadedTokenizer, text: str, n: int, *, fresh: bool = True) -> tuple[int, int]:
    """(encode calls, ids produced) for one ``prefix_ids`` without the cache.

    :param fresh: as a new copy (nothing learned yet), else with what ``tok`` learned.
    """
    calls: list[int] = []
    real = LoadedTokenizer._encode_piece

    def counting(self: LoadedTokenizer, text: str) -> list[int]:
        ids = real(self, text)
        calls.append(len(ids))
        return ids

    expected = tok.encode(text, add_special_tokens=False)[:n]
    tok._encode_cut.cache_clear()
    if fresh:
        tok._density = BYTES_PER_TOKEN
    LoadedTokenizer._encode_piece = counting  # type: ignore[method-assign]
    try:
        assert tok.prefix_ids(text, n) == expected
    finally:
        LoadedTokenizer._encode_piece = real  # type: ignore[method-assign]
    return len(calls), sum(calls)


def _filler(seed: int, chars: int) -> str:
    """The benchmark's prompt text (~5.5 characters per Qwen token)."""
    vocabulary = (
        "the of and to in is for on that with model token cache prefix router worker "
        "request latency throughput prompt system user assistant context window attention "
        "layer batch decode prefill kernel memory vector matrix tensor gradient sample"
    )
    words = vocabulary.split(" ")
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(chars // 4))[:chars]


@pytest.mark.parametrize(
    ("text", "most"),
    [
        pytest.param(_filler(1, 16_000), 1.25, id="filler"),
        pytest.param("The quick brown fox jumps over the lazy dog. " * 400, 1.25, id="english"),
        pytest.param(Path(tokenizers_module.__file__).read_text()[:16_000], 1.25, id="code"),
        pytest.param("中文测试，这是一个句子。" * 1500, 1.25, id="cjk"),
        # 2.5 bytes per token, denser than the aim (3.5 x 1.05): one piece, 1.47x
        pytest.param("def f(x):\n    return x + 1\n" * 600, 1.5, id="dense"),
    ],
)
def test_a_short_first_cut_is_continued_not_redone(
    qwen: LoadedTokenizer, text: str, most: float
) -> None:
    # Not a timing: how much text the tokenizer reads for 256 ids. The first cut
    # aims a little short; the continuation reads only the ids still missing.
    calls, ids = _reads(qwen, text, 256)
    assert calls <= 3
    assert 256 <= ids <= 256 * most, (calls, ids)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda i: _filler(100 + i, 16_000), id="filler"),
        pytest.param(lambda i: "中文测试，这是一个句子。" * (1000 + i), id="cjk"),
    ],
)
def test_the_first_piece_learns_the_density(qwen: LoadedTokenizer, make: Any) -> None:
    # After a few prompts of a kind, one piece holds the 256 ids, without reading
    # much more than them (not a timing: calls and ids read).
    qwen._density = BYTES_PER_TOKEN
    for i in range(20):
        qwen.prefix_ids(make(i), 256)
    lo, hi = DENSITY_RANGE
    assert lo <= qwen._density <= hi
    calls, ids = _reads(qwen, make(50), 256, fresh=False)
    assert calls == 1
    assert 256 <= ids <= 256 * 1.2


def test_an_odd_text_moves_the_aim_within_bounds(qwen: LoadedTokenizer) -> None:
    qwen._density = BYTES_PER_TOKEN
    for _ in range(20):
        qwen.prefix_ids(("=" * 64 + " ") * 300, 64)  # long runs: many bytes per token
    assert qwen._density == pytest.approx(DENSITY_RANGE[1], rel=0.01)
    for _ in range(20):
        qwen.prefix_ids("def f(x):\n    return x + 1\n" * 600, 64)  # dense: ~2.5
    assert DENSITY_RANGE[0] <= qwen._density < 3.0


def test_continuing_is_cached_piece_by_piece(qwen: LoadedTokenizer) -> None:
    text = _filler(7, 16_000)
    calls, _ = _reads(qwen, text, 256)
    assert calls == 2  # this text is sparser than the aim: one continuation
    qwen._density = BYTES_PER_TOKEN  # the same aim, so the same pieces
    expected = qwen.prefix_ids(text, 256)
    info = qwen._encode_cut.cache_info()
    qwen._density = BYTES_PER_TOKEN
    assert qwen.prefix_ids(text, 256) == expected
    assert qwen._encode_cut.cache_info().hits == info.hits + 2


def test_a_lone_surrogate_is_an_invalid_request(tiny: LoadedTokenizer) -> None:
    with pytest.raises(InvalidRequest, match="surrogate"):
        tiny.encode("abc\ud800", add_special_tokens=False)


def test_edges(tiny: LoadedTokenizer) -> None:
    assert tiny.prefix_ids("anything", 0) == []
    assert tiny.prefix_ids("", 5) == []
    short = "the quick brown fox"
    assert tiny.prefix_ids(short, 1000) == tiny.encode(short, add_special_tokens=False)
    long = "the quick brown fox " * 1000
    assert len(tiny.prefix_ids(long, 256)) == 256


# -- the GIL: never `encode` -----------------------------------------------------------


class _NoEncode:
    """Forwards to a tokenizer but refuses the GIL-holding calls."""

    def __init__(self, inner: Tokenizer, *, fast: bool = True) -> None:
        self._inner = inner
        self._fast = fast
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name in ("encode", "decode") or (name == "encode_batch_fast" and not self._fast):
            raise AttributeError(f"{name} must not be used")
        self.calls.append(name)
        return getattr(self._inner, name)


def test_every_encode_goes_through_the_batch_api(tiny: LoadedTokenizer) -> None:
    text = "the quick brown fox jumps " * 50
    expected = tiny.encode(text, add_special_tokens=False)
    for fast, name in ((True, "encode_batch_fast"), (False, "encode_batch")):
        copy = tiny.copy()
        proxy = _NoEncode(copy.tokenizer, fast=fast)
        copy.tokenizer = proxy  # type: ignore[assignment]
        assert copy.encode(text, add_special_tokens=False) == expected
        assert copy.prefix_ids(text, 16) == expected[:16]
        assert copy.decode(expected[:5]) == tiny.decode(expected[:5])
        assert name in proxy.calls
        assert "decode_batch" in proxy.calls


@pytest.mark.parametrize("entries", [2, None])
def test_prefix_pieces_remembered_are_bounded_by_prefix_cache_entries(
    entries: int | None, tiny_dir: Path
) -> None:
    prepare = {} if entries is None else {"prefix_cache_entries": entries}
    mesh = Mesh(workers=["http://127.0.0.1:9"], tokenizer=str(tiny_dir), prepare=prepare)
    try:
        tok = mesh.tokenizers.get(None)
        assert tok is not None
        for seed in range(8):  # eight different texts: eight first pieces
            tok.prefix_ids(_filler(seed, 16_000), 256)
        for t in (tok, tok.copy()):  # each copy of the pool's threads alike
            assert t._encode_cut.cache_info().maxsize == (entries or 512)
        held = tok._encode_cut.cache_info().currsize
        assert held == 2 if entries else held >= 8
    finally:
        mesh.close()
