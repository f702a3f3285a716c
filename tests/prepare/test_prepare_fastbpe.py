"""The tiktoken fast path for prefix ids: exact where it is used, off everywhere else."""

from __future__ import annotations

import json
import logging
import sys
import threading
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from test_prepare_prefix import SPECIAL_FRAGMENTS, TRICKY, WHITESPACE, prop, segment, texts
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from meshkit.config import PrepareConfig
from meshkit.prepare import fastbpe
from meshkit.prepare.tokenizers import LoadedTokenizer, TokenizerRegistry, TokenizerSpec

pytest.importorskip("tiktoken")

# -- fixtures ----------------------------------------------------------------------------

CORPUS = [
    "the quick brown fox jumps over the lazy dog. It's 12345 o'clock!\n",
    "def f(x):\n    return x ** 2  # code\n\n",
    "中文测试，这是一个句子。 café naïve 😀👍🏽",
] * 30


def _byte_level_bpe(tmp: Path, *, nfc: bool = True) -> Path:
    """A small byte-level BPE the fast path covers: merges from the trainer, no
    special tokens inside the model vocabulary, two added after training."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|end|>", "<|im_start|>"])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def small_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _byte_level_bpe(tmp_path_factory.mktemp("fastbpe"))


@pytest.fixture(scope="module")
def small(small_path: Path) -> LoadedTokenizer:
    return TokenizerSpec(small_path).load()


def _edited(path: Path, tmp_path: Path, edit: Any) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    out = tmp_path / "tokenizer.json"
    out.write_text(json.dumps(data))
    return out


# -- the property on the real Qwen tokenizer ----------------------------------------------

NFC_CHANGES = ["e\u0301", "A\u030a", "\u1100\u1161", "\u212b", "\u037e", ">\u0338", "\u0958"]
fast_texts = st.one_of(
    texts,
    st.lists(
        st.one_of(
            segment,
            st.sampled_from(NFC_CHANGES),
            st.builds(lambda w, k: w * k, st.sampled_from(WHITESPACE), st.integers(1, 200)),
        ),
        min_size=1,
        max_size=60,
    ).map("".join),
)


@pytest.mark.parametrize("n", [1, 16, 256])
@prop(150)
@given(text=fast_texts)
@example(text="<|im_end|>\u0338 and more")  # NFC of the whole text would lose the token
@example(text="".join(SPECIAL_FRAGMENTS) * 20)
@example(text="".join(TRICKY) * 20)
@example(text=" " * 3000 + "x" + "\n" * 3000 + "\t \t" * 500)
def test_fast_prefix_ids_equal_the_full_encode_qwen(
    qwen: LoadedTokenizer, n: int, text: str
) -> None:
    assert qwen.fast_bpe
    full = qwen.encode(text, add_special_tokens=False)
    assert qwen._info.fast is not None
    fast = qwen._info.fast.encode(text)
    if fast is not None:  # where it answers, it is the whole encode
        assert fast == full
    assert qwen._encode_piece(text) == full
    qwen._encode_cut.cache_clear()
    assert qwen.prefix_ids(text, n) == full[:n]
    # The event loop's variant: the same ids, or None (then the pool's prefix_ids).
    inline = qwen.prefix_ids_fast(text, n)
    assert inline is None or inline == full[:n]
    if text.isascii():
        assert inline == full[:n]


def test_the_fast_path_answers_for_ordinary_text(qwen: LoadedTokenizer) -> None:
    fast = qwen._info.fast
    assert fast is not None
    for text in (
        "hello world",
        "中文测试，句子。",
        "emoji 😀👍🏽🇫🇷",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert fast.encode(text) == qwen.encode(text, add_special_tokens=False)
    added = qwen.tokenizer.get_added_tokens_decoder()
    for token_id, token in added.items():
        assert fast.encode(f"x{token.content}y")[1:-1] == [token_id]  # type: ignore[index]


def test_the_plain_encode_serves_texts_without_an_added_tokens_start(
    qwen: LoadedTokenizer,
) -> None:
    # Qwen's added tokens all start with "<": a text without one takes tiktoken's
    # plain encode (no search for them); one with a "<" the full one.
    fast = qwen._info.fast
    assert fast is not None
    assert fast._special_firsts == "<"
    for text in ("plain words here", "a < b <= c", "x<|im_end|>y", "<|endoftext|>"):
        assert fast.encode(text) == qwen.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "text",
    ["<|im_end|>\u0338", "e\u0301", "\u212b", "abc\U000e0080", "abc\u0378", "lone \ud800"],
)
def test_texts_the_fast_path_declines(qwen: LoadedTokenizer, text: str) -> None:
    # Not NFC, an unassigned code point (U+E0080, U+0378) or a surrogate: tokenizers.
    assert qwen._info.fast is not None
    assert qwen._info.fast.encode(text) is None


@pytest.mark.parametrize("at", [0, 3000])
def test_prefix_ids_fast_declines_what_tiktoken_does_not_cover(
    qwen: LoadedTokenizer, at: int
) -> None:
    # A piece that is not NFC, at the start or past the first cut (the cached
    # pieces before it do not make the whole answer).
    text = "word " * (at // 5) + "e\u0301 caf\u00e9 " + "more words " * 300
    qwen._encode_cut.cache_clear()
    assert qwen.prefix_ids_fast(text, 2000) is None
    assert qwen.prefix_ids(text, 2000) == qwen.encode(text, add_special_tokens=False)[:2000]
    assert qwen.prefix_ids_fast("plain text " * 100, 0) == []


def test_prefix_ids_fast_is_off_without_tiktoken_paths(small_path: Path) -> None:
    off = TokenizerSpec(small_path).load(fast=False)
    assert off.prefix_ids_fast("hello world " * 50, 16) is None


def test_why_nfc_is_not_applied_to_the_whole_text(qwen: LoadedTokenizer) -> None:
    # HF splits added tokens out of the raw text, then normalizes the rest: ">" +
    # U+0338 composes into "≯" only when normalized together.
    text = "<|im_end|>\u0338"
    assert qwen.encode(text, add_special_tokens=False)[0] == 151645
    assert qwen._info.fast is not None
    encoding = qwen._info.fast._encoding
    assert encoding.encode(unicodedata.normalize("NFC", text), allowed_special="all")[0] != 151645


# -- detection ------------------------------------------------------------------------------


def test_a_covered_byte_level_bpe(small: LoadedTokenizer) -> None:
    assert small.fast_bpe
    text = "".join(CORPUS[:3]) * 5 + "<|end|><|im_start|>"
    assert small._info.fast is not None
    assert small._info.fast.encode(text) == small.encode(text, add_special_tokens=False)


@prop(100)
@given(text=fast_texts)
def test_fast_ids_equal_the_full_encode_small(small: LoadedTokenizer, text: str) -> None:
    assert small._encode_piece(text) == small.encode(text, add_special_tokens=False)


def test_not_covered(tiny: LoadedTokenizer, small_path: Path, tmp_path: Path) -> None:
    # The tiny fixture keeps its special tokens inside the model vocabulary.
    assert not tiny.fast_bpe
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert not TokenizerSpec(tmp_path).load().fast_bpe

    def changed(key: str, value: Any) -> Any:
        def edit(data: dict[str, Any]) -> None:
            data[key] = value

        return edit

    def model(key: str, value: Any) -> Any:
        def edit(data: dict[str, Any]) -> None:
            data["model"][key] = value

        return edit

    def added(flag: str) -> Any:
        def edit(data: dict[str, Any]) -> None:
            data["added_tokens"][0][flag] = True

        return edit

    edits = [
        changed("normalizer", {"type": "NFKC"}),
        changed("normalizer", {"type": "Sequence", "normalizers": [{"type": "NFC"}]}),
        changed("decoder", None),
        changed(
            "pre_tokenizer",
            {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
        ),
        changed(
            "pre_tokenizer",
            {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": r"\s+"},
                        "behavior": "Isolated",
                        "invert": False,
                    },
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": False,
                        "use_regex": False,
                    },
                ],
            },
        ),
        model("dropout", 0.1),
        model("byte_fallback", True),
        added("lstrip"),
        added("normalized"),
    ]
    for i, edit in enumerate(edits):
        out = tmp_path / str(i)
        out.mkdir()
        assert not TokenizerSpec(_edited(small_path, out, edit)).load().fast_bpe, i


def _swap_two_merged_tokens(data: dict[str, Any]) -> None:
    vocab = data["model"]["vocab"]
    merges = data["model"]["merges"]
    first, last = ("".join(m.split(" ")) if isinstance(m, str) else "".join(m) for m in merges[:2])
    vocab[first], vocab[last] = vocab[last], vocab[first]


def test_a_tampered_vocabulary_falls_back_with_a_warning(
    small_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _edited(small_path, tmp_path, _swap_two_merged_tokens)
    with caplog.at_level(logging.DEBUG, logger="meshkit.prepare"):
        tok = TokenizerSpec(path).load()
    assert not tok.fast_bpe
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "fast tokenizer disabled" in warnings[0].getMessage()
    text = "the quick brown fox " * 50
    assert tok.prefix_ids(text, 16) == tok.encode(text, add_special_tokens=False)[:16]


def test_the_load_time_samples_catch_a_difference(
    small_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Ranks that pass the structural checks but encode differently: two frequent
    # tokens' ranks swapped after the checks.
    real = fastbpe._mergeable_ranks

    def tampered(vocab: dict[str, int], merges: list[Any]) -> dict[bytes, int]:
        ranks = real(vocab, merges)
        a, b = b"the", b" the"
        if a in ranks and b in ranks:
            ranks[a], ranks[b] = ranks[b], ranks[a]
        else:  # whatever the trainer made: the two first merged tokens
            first, second = sorted((r, t) for t, r in ranks.items() if len(t) > 1)[:2]
            ranks[first[1]], ranks[second[1]] = second[0], first[0]
        return ranks

    monkeypatch.setattr(fastbpe, "_mergeable_ranks", tampered)
    with caplog.at_level(logging.WARNING, logger="meshkit.prepare"):
        tok = TokenizerSpec(small_path).load()
    assert not tok.fast_bpe
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [
        "fast tokenizer disabled, tokenizers is used instead: different ids on a built-in sample"
    ]


# -- switched off --------------------------------------------------------------------------


def test_without_tiktoken_nothing_changes(
    small_path: Path, small: LoadedTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    assert not fastbpe.tiktoken_available()
    tok = TokenizerSpec(small_path).load()
    assert not tok.fast_bpe
    calls: list[str] = []
    real = tok.tokenizer

    class Spy:
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(real, name)

    tok.tokenizer = Spy()  # type: ignore[assignment]
    text = "".join(CORPUS[:3]) * 20
    for n in (1, 16, 256):
        assert tok.prefix_ids(text, n) == small.prefix_ids(text, n)
    assert "encode_batch_fast" in calls  # the pieces went through tokenizers


def test_switched_off_by_configuration(small_path: Path) -> None:
    assert PrepareConfig().fast_tokenizer is True
    assert not TokenizerSpec(small_path).load(fast=False).fast_bpe
    off = TokenizerRegistry(fast_tokenizer=False)
    assert not off.register(None, small_path).fast_bpe
    on = TokenizerRegistry()
    assert on.register(None, small_path).fast_bpe
    copy = on.get(None)
    assert copy is not None
    assert copy.copy().fast_bpe  # copies share the encoder


# -- the GIL ------------------------------------------------------------------------------


def test_tiktoken_releases_the_gil(qwen: LoadedTokenizer) -> None:
    """While one thread encodes a long text, another keeps running Python.

    Not a timing: with the GIL held for the whole call the counter would stay
    near zero; it counts loop turns, and only needs a few.
    """
    fast = qwen._info.fast
    assert fast is not None
    text = "the quick brown fox jumps over the lazy dog " * 100_000  # 4.4 MB, ~0.1 s
    started = threading.Event()
    done = threading.Event()

    def encode() -> None:
        started.set()
        for _ in range(3):
            fast.encode(text)
        done.set()

    thread = threading.Thread(target=encode)
    thread.start()
    started.wait()
    turns = 0
    while not done.is_set():
        turns += 1
        done.wait(0.001)
    thread.join()
    assert turns >= 10
