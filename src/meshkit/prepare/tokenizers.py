"""
Tokenizers
==========

HuggingFace ``tokenizer.json`` files loaded from a local path — never a hub
download — with the chat template and special tokens of the
``tokenizer_config.json`` beside them.

- :class:`TokenizerSpec` names the files and loads them.
- :class:`LoadedTokenizer` is one tokenizer instance: ``encode``, ``decode``,
  ``prefix_ids`` and chat rendering.
- :class:`TokenizerRegistry` holds one tokenizer per model (``None`` is the
  default) and hands each preparation thread its group's copy.

The GIL
-------

``Tokenizer.encode`` holds the GIL for the whole encode: a second Python thread
— the event loop — stalls. ``encode_batch_fast([text])`` (or ``encode_batch``
where it does not exist) releases it, so every encode here goes through the batch
API, and decoding through ``decode_batch``.

Copies per group
----------------

A BPE model guards its word cache with one lock; shared by many threads, one
instance loses about a third of its throughput. Pool thread ``N`` uses copy
``N // workers_per_tokenizer``, built from the same JSON bytes on first use (or
ahead of time with ``workers=``). Copies belong to a registration: registering
a model again or removing it drops them with it; a thread already holding the
old instance finishes its job with it.

Bounded-prefix tokenization
---------------------------

A policy that hashes the first ``n`` tokens of a 1 MiB prompt should not
tokenize 1 MiB. :meth:`LoadedTokenizer.prefix_ids` tokenizes a prefix ``P`` of
the text ``T = P + S``, cut at a position ``c`` chosen so that the ids of ``P``
are exactly the first ids of ``T``. It aims at ``n`` times the UTF-8 bytes per
token of the prefixes it cut before, plus 5 % (a moving average kept within 2.5 to 6;
3.5 before the first: with a ~150k vocabulary English prose runs ~4.5 bytes per
token, code ~4.2, Markdown ~3.5, CJK ~3; aiming a little short is cheap, see below),
and moves forward to the next *safe cut*; when no safe cut exists past the aim, it
tokenizes the whole text. The aim only decides how the text is split into pieces,
never which ids come out.

When ``P`` yields fewer than ``n`` ids, the ids of ``P`` are kept and the text is
*continued* from ``c``: the next piece, up to a safe cut past the ids still
missing (at the characters per token seen so far, plus 15 %), is tokenized on its
own and its ids appended. The tokenizer's cost is linear in the text it reads
(~1.2 µs per token for Qwen on one core), so a shortfall costs one more call
(~10 µs), not a re-encode of the prefix: before this, a short first cut was thrown
away and twice the text encoded again, ~730 tokens read for 256
(benchmarks/RESULTS.notes.md, 30 Nov 2026).

When is a cut safe? A tokenizer runs four steps: split out added tokens,
normalize, pre-tokenize (split into pre-tokens), and apply the model (BPE) to
each pre-token separately — the model never sees across a pre-token boundary.
So if every step treats ``c`` as a boundary of ``T``, the pre-tokens of ``P``
are those of ``T`` before ``c``, and ``ids(P)`` is a prefix of ``ids(T)``. Step
by step:

*Added tokens* (``<|im_start|>`` ...) are found by string matching. A cut inside
an occurrence would split it, so a cut is refused when an added token occurs
across it (in the raw text, and in the normalized text for normalized added
tokens). Otherwise every occurrence before ``c`` is found in ``P`` as in ``T``;
``lstrip``/``rstrip`` absorb only whitespace, and the token keeps its id.

*Normalization* (none or NFC for a proven tokenizer). NFC composes a character
with what precedes it only when it is a combining mark or one of the few
starters that compose (Hangul vowels, some Indic vowel signs). A cut always
stands before horizontal whitespace or before punctuation or a symbol (Unicode
categories P and S): class 0, never the second half of a composition, and still
whitespace, punctuation or a symbol after NFC. Hence
``NFC(P + S) == NFC(P) + NFC(S)``. The tests check these facts over every code
point. NFKC and other normalizers map symbols to letters (``™`` → ``TM``): not
proven.

*Pre-tokenization* — the regex of Qwen 2 (cl100k/Llama 3 differ only in
``\\p{N}{1,3}``, GPT-2 in ``' ?'`` prefixes instead of the optional
non-letter)::

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}
    | ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+

Matches are found left to right, and each alternative only scans a run of one
kind of character (letters, digits, punctuation, whitespace) plus one character
of look-ahead. ``P`` and ``T`` agree before ``c``, so every match is the same in
both up to the last run before ``c``; the match that reaches ``c`` must also stop
at ``c`` in ``T``. Two shapes guarantee it:

1. **non-whitespace, then a space, a tab or U+3000.** No alternative continues a
   non-whitespace character with whitespace — except ``[\\r\\n]*`` after
   punctuation, which is why ``\\r`` and ``\\n`` are not in this set.
   Whitespace only begins a match (``" word"``, ``\\s+(?!\\S)``). A cut *inside*
   a whitespace run would not be safe: ``\\s+(?!\\S)`` leaves the last space of a
   run to the following word, so the run splits differently where the text ends.
2. **a letter or digit, then punctuation, a symbol, ``\\r`` or ``\\n``.** Letter
   and digit runs stop before them, and no alternative puts punctuation *after* a
   letter or digit (it may start one: ``",word"``). This makes CJK text — no
   spaces, but ideographic commas and full stops — cuttable. Left out: the few
   letters NFC splits into a letter and a mark (composition exclusions such as
   U+0958 क़), because the trailing mark joins the punctuation after it.

The ``Whitespace``, ``WhitespaceSplit`` and ``BertPreTokenizer`` pre-tokenizers
split at every whitespace character: shape 1, plus ``\\r``/``\\n``, holds there.

The tests check the conclusion itself on random text (unicode, long words, no
whitespace, CJK, code, repeated characters, special tokens): for every cut
chosen, the ids of ``P`` are the first ids of ``T`` with the real Qwen
tokenizer, and mutations of the rules above are caught.

Tokenizers outside these families (a Metaspace, an unknown regex, NFKC, a
``Replace`` normalizer) get whitespace cuts, and the result is *checked* rather
than proven: the first ``n`` ids must agree with those of a cut at least twice
as far; otherwise the cut grows and the check repeats.

Finding a cut is a C-speed regex scan for candidate characters (the Basic
Multilingual Plane's punctuation and symbols; emoji are merely not used) with a
little Python per candidate, at most 256 rejected candidates: adversarial text
holds the GIL for at most a few tens of milliseconds per MiB. A text with no
safe cut past the aim (one long word, repeated characters, CJK without
punctuation) is tokenized whole — exact, at the full price (with the GIL
released), bounded by ``max_tokenize_bytes``.

Continuing from a cut
---------------------

Why is ``ids(T) == ids(P) + ids(S)`` at a safe cut, so that ``S`` may be
tokenized on its own? The same steps, from the other side. *Added tokens*: none
occurs across ``c``, and one before ``c`` ends before it, so the matches at or
after ``c`` in ``T`` are those of ``S`` — provided no added token strips the
whitespace next to it (``lstrip``/``rstrip``: a space after ``c`` absorbed in
``T`` would be a token of ``S``). *Normalization*: ``NFC(P + S) == NFC(P) +
NFC(S)`` (above). *Pre-tokenization*: the match reaching ``c`` stops there, so
the next match of ``T`` starts at ``c``; none of the regexes above looks behind
or anchors, so matching ``T`` from ``c`` is matching ``S`` from 0 — provided no
step inserts text at the start of its input (``add_prefix_space``, a Metaspace
``prepend_scheme``). *The model* sees each pre-token alone. And without special
tokens the post-processor adds nothing. Applied twice, a piece between two safe
cuts ``T[a:b]`` has the ids ``T`` has there, so pieces are cached by their text.
A tokenizer the conditions do not cover (whitespace-stripping added tokens, a
prefix space, the ``checked`` family) restarts from 0 with a longer cut instead.
The property tests check pieces and their concatenation against the full encode.

With ``add_special_tokens=True`` the tokens the post-processor puts in front of
every text (a BOS) are prepended; they are measured once per tokenizer.

The fast path
-------------

With ``tiktoken`` installed (the ``fast`` extra) and ``prepare.fast_tokenizer``
on, a byte-level BPE of the shape :mod:`meshkit.prepare.fastbpe` proves
equivalent (Qwen, Llama 3, GPT-2 style) also gets a ``tiktoken`` encoder, built
once per registration and shared by every copy (it has no lock and releases the
GIL). Only the pieces of :meth:`LoadedTokenizer.prefix_ids` go through it
(~30 µs instead of ~250 µs for 1,000 characters of Qwen): the cuts, the cache
and the conditions to restart from 0 are the ones above, since the pieces get
the very ids ``tokenizers`` gives them. A piece the fast encoder declines (not
NFC, a code point Python's tables leave unassigned, a surrogate) goes through
``tokenizers``; ``encode`` and ``decode`` always do.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from meshkit.errors import ConfigError, InvalidRequest
from meshkit.prepare.pool import current_worker_index

if TYPE_CHECKING:
    # The libraries load with the first tokenizer (``import meshkit`` stays light).
    from tokenizers import Tokenizer

    from meshkit.prepare.fastbpe import FastEncoder
    from meshkit.prepare.templates import RenderBudget

__all__ = [
    "CutMode",
    "LoadedTokenizer",
    "TokenizerRegistry",
    "TokenizerSpec",
]

CutMode = Literal["regex", "whitespace", "checked"]

#: The first cut aims at ``n`` times the UTF-8 bytes per token of the prefixes this
#: copy cut before (``BYTES_PER_TOKEN`` until it has cut one), times ``AIM_SLACK``.
#: Bytes per token vary less across scripts than characters do (Qwen: English prose
#: ~4.5, Markdown ~3.5, code ~4.2, CJK ~3, benchmark filler ~5.5), and a deployment's
#: prompts are alike, so one piece usually holds the ``n`` ids. Aiming short costs
#: one more piece (a cut, a call: ~15 us with tiktoken); aiming long, ~0.2 us per
#: extra token with tiktoken and ~1.2 us with ``tokenizers``.
BYTES_PER_TOKEN: Final = 3.5
AIM_SLACK: Final = 1.05
#: The learned bytes per token stay in this range, so one odd text (a run of
#: ``=``: many bytes per token) cannot make the next aims much too long.
DENSITY_RANGE: Final = (2.5, 6.0)
#: Weight of the newest prefix in the learned bytes per token (a moving average).
DENSITY_WEIGHT: Final = 0.25
#: A continuation aims at the ids still missing times the characters per token
#: seen so far, times this, plus ``CONTINUE_MARGIN`` characters.
CONTINUE_SLACK: Final = 1.15
CONTINUE_MARGIN: Final = 8
#: After this many short pieces each continuation is at least as long as the text
#: read so far: a text whose density keeps changing still ends in a few calls.
CONTINUE_PIECES: Final = 3
#: Pieces (text between two safe cuts) remembered per tokenizer copy by default
#: (``prepare.prefix_cache_entries``): a shared system prompt longer than the cut
#: is tokenized once, not once per request.
PREFIX_CACHE_SIZE: Final = 512

# The pre-tokenizer regexes the proof above covers, as tokenizer.json spells them.
_GPT2_REGEX: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_KNOWN_REGEXES: Final = frozenset(
    {
        _GPT2_REGEX,
        # Qwen 2 / 2.5 / 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        # cl100k / Llama 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
_WHITESPACE_PRE_TOKENIZERS: Final = frozenset({"Whitespace", "WhitespaceSplit", "BertPreTokenizer"})

# HF writes this for "no limit" (transformers' VERY_LARGE_INTEGER is 1e30).
_NO_MAX_LENGTH: Final = 10**12


# -- safe cuts ---------------------------------------------------------------------


def _class_of(codepoints: Iterable[int]) -> str:
    """A regex character class body for sorted code points, as escaped ranges."""
    parts: list[str] = []
    start = prev = -2
    for cp in codepoints:
        if cp != prev + 1:
            if start >= 0:
                parts.append(_range(start, prev))
            start = cp
        prev = cp
    if start >= 0:
        parts.append(_range(start, prev))
    return "".join(parts)


def _range(lo: int, hi: int) -> str:
    esc = "\\U{:08x}"
    return esc.format(lo) if lo == hi else f"{esc.format(lo)}-{esc.format(hi)}"


@functools.cache
def _unicode_tables() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Code points of categories P*/S*, and letters/digits NFC does not keep whole.

    The second set holds the composition exclusions among letters (U+0958 क़
    becomes क + nukta, a mark): after one of them the text ends in a mark, which
    the regex groups with following punctuation, so no cut goes there.
    """
    punct_symbol = []
    unstable_alnum = []
    for cp in range(0x110000):
        ch = chr(cp)
        if unicodedata.category(ch)[0] in "PS":
            punct_symbol.append(cp)
        elif ch.isalnum() and not unicodedata.normalize("NFC", ch)[-1].isalnum():
            unstable_alnum.append(cp)
    return tuple(punct_symbol), tuple(unstable_alnum)


def punct_symbol_codepoints() -> tuple[int, ...]:
    """Every code point in Unicode categories P* and S* (Python's tables)."""
    return _unicode_tables()[0]


def unstable_alnum_codepoints() -> tuple[int, ...]:
    """Letters and digits whose NFC form does not end with a letter or digit."""
    return _unicode_tables()[1]


#: Whitespace a cut may stand before: never composes, never continues a match.
CUT_WHITESPACE: Final = " \t\u3000"


#: Candidates rejected before giving up on a cut (and tokenizing the whole text):
#: bounds the GIL-holding Python work of a scan on adversarial text.
MAX_REJECTED_CUTS: Final = 256


@dataclass(frozen=True)
class _CutScanner:
    """Finds safe cuts with C-speed regex scans and a little Python per candidate."""

    candidate: re.Pattern[str]  # one character a cut may stand before
    run: re.Pattern[str]  # a run of such characters
    proven_after_alnum: bool  # shape 2: punctuation/symbol/newline after a letter or digit
    unstable: frozenset[str]  # letters NFC does not keep whole: no shape-2 cut after them


# Shape 1 inside a run of candidates: horizontal whitespace after non-whitespace.
# Python's \s is str.isspace(): a superset of Unicode White_Space (it adds
# U+001C..U+001F), so "not \s" errs on the safe side.
_SPACE_AFTER_NON_SPACE: Final = re.compile(rf"[^\s][{CUT_WHITESPACE}]")


@functools.cache
def _scanner(mode: CutMode) -> _CutScanner:
    if mode == "regex":
        # Basic Multilingual Plane only: supplementary ranges (emoji) would make
        # the character class a slow list of ranges; they are merely not used.
        bmp = (cp for cp in punct_symbol_codepoints() if cp < 0x10000)
        chars = f"{CUT_WHITESPACE}\r\n{_class_of(bmp)}"
        unstable = frozenset(chr(cp) for cp in unstable_alnum_codepoints())
    else:
        chars = f"{CUT_WHITESPACE}\r\n"
        unstable = frozenset()
    return _CutScanner(
        candidate=re.compile(f"[{chars}]"),
        run=re.compile(f"[{chars}]+"),
        proven_after_alnum=mode == "regex",
        unstable=unstable,
    )


def _component(obj: Any) -> dict[str, Any] | None:
    """The JSON of a tokenizer component (normalizer, pre-tokenizer), or None."""
    if obj is None:
        return None
    state = obj.__getstate__()
    data = json.loads(state)
    return data if isinstance(data, dict) else None


def _normalizer_proven(norm: dict[str, Any] | None) -> bool:
    if norm is None:
        return True
    if norm.get("type") == "NFC":
        return True
    if norm.get("type") == "Sequence":
        return all(_normalizer_proven(n) for n in norm.get("normalizers", []))
    return False


def _split_regex(pre: dict[str, Any]) -> str | None:
    if pre.get("type") != "Split" or pre.get("invert") or pre.get("behavior") != "Isolated":
        return None
    pattern = pre.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    return regex if isinstance(regex, str) else None


def _inserts_text(component: Any) -> bool:
    """Whether a pre-tokenizer (JSON) may insert text at the start of its input."""
    if isinstance(component, list):
        return any(_inserts_text(c) for c in component)
    if not isinstance(component, dict):
        return False
    if component.get("add_prefix_space") is True:
        return True
    if component.get("type") == "Metaspace" and component.get("prepend_scheme") != "never":
        return True
    return any(_inserts_text(v) for v in component.values() if isinstance(v, dict | list))


def appendable(tokenizer: Tokenizer, mode: CutMode) -> bool:
    """Whether text after a safe cut may be tokenized alone (module documentation)."""
    if mode == "checked":
        return False
    added = tokenizer.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):
        return False
    return not _inserts_text(_component(tokenizer.pre_tokenizer))


def classify(tokenizer: Tokenizer) -> CutMode:
    """How far the safe-cut argument of the module documentation covers a tokenizer."""
    if not _normalizer_proven(_component(tokenizer.normalizer)):
        return "checked"
    pre = _component(tokenizer.pre_tokenizer)
    if pre is None:
        return "checked"
    kind = pre.get("type")
    if kind == "ByteLevel":
        return "regex" if pre.get("use_regex", True) else "checked"
    if kind == "Split":
        return "regex" if _split_regex(pre) in _KNOWN_REGEXES else "checked"
    if kind in _WHITESPACE_PRE_TOKENIZERS:
        return "whitespace"
    if kind == "Sequence":
        steps = pre.get("pretokenizers", [])
        if (
            len(steps) == 2
            and _split_regex(steps[0]) in _KNOWN_REGEXES
            and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)
        ):
            return "regex"
        if steps and all(s.get("type") in _WHITESPACE_PRE_TOKENIZERS for s in steps):
            return "whitespace"
    return "checked"


# -- files ---------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _chat_template(config: Mapping[str, Any], directory: Path) -> str | None:
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        # Several named templates: HF picks "default".
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    jinja = directory / "chat_template.jinja"  # newer transformers save it apart
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return None


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a tokenizer lives: a ``tokenizer.json`` file or the directory holding it.

    ``tokenizer_config.json`` beside it (optional) supplies ``chat_template``,
    ``bos_token``, ``eos_token`` and ``model_max_length``; ``max_model_len``
    overrides the latter.
    """

    path: Path
    max_model_len: int | None = None

    def __init__(self, path: str | os.PathLike[str], max_model_len: int | None = None) -> None:
        object.__setattr__(self, "path", Path(path))
        object.__setattr__(self, "max_model_len", max_model_len)

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json" if self.path.is_dir() else self.path

    def load(self, *, fast: bool = True, cache_entries: int = PREFIX_CACHE_SIZE) -> LoadedTokenizer:
        """Read the files and build the first instance.

        :param fast: use tiktoken for prefix ids where it is exact (``fast_bpe``).
        :param cache_entries: prefix pieces each copy remembers.
        :raises ConfigError: when the files are missing or invalid.
        """
        file = self.tokenizer_file
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise ConfigError("tokenizer", f"cannot read {file}: {exc.strerror}") from exc
        try:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_buffer(data)
        except Exception as exc:  # the binding raises a bare Exception
            raise ConfigError("tokenizer", f"{file} is not a tokenizer.json: {exc}") from exc
        config: dict[str, Any] = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                loaded = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError("tokenizer", f"cannot read {config_file}: {exc}") from exc
            if isinstance(loaded, dict):
                config = loaded
        max_len = self.max_model_len
        if max_len is None:
            raw = config.get("model_max_length")
            if isinstance(raw, int | float) and 0 < raw < _NO_MAX_LENGTH:
                max_len = int(raw)
        info = _Info.build(
            self,
            data,
            tokenizer,
            chat_template=_chat_template(config, file.parent),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            max_model_len=max_len,
            fast=fast,
        )
        return LoadedTokenizer(info, tokenizer, cache_entries)


def _prepare(tokenizer: Tokenizer) -> Tokenizer:
    # Counting and routing want every token: a tokenizer.json may ship with
    # truncation or padding switched on.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


@dataclass(frozen=True)
class _Info:
    """What every copy of one registration shares."""

    spec: TokenizerSpec
    json_bytes: bytes = field(repr=False)  # copies are built from these very bytes
    chat_template: str | None = field(repr=False)
    bos_token: str | None
    eos_token: str | None
    max_model_len: int | None
    mode: CutMode
    appendable: bool  # ids(T) == ids(T[:c]) + ids(T[c:]) at a safe cut c
    added: tuple[str, ...]  # added-token contents of 2+ characters, longest first
    added_firsts: str  # their first characters, each once
    normalized_added: bool  # some added token is matched after normalization
    head: tuple[int, ...] | None  # ids the post-processor puts before every text
    fast: FastEncoder | None  # tiktoken, exact for prefix pieces (shared: it has no lock)

    @classmethod
    def build(
        cls,
        spec: TokenizerSpec,
        json_bytes: bytes,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        max_model_len: int | None,
        fast: bool = True,
    ) -> _Info:
        from meshkit.prepare.fastbpe import build_fast_encoder

        _prepare(tokenizer)
        added_tokens = list(tokenizer.get_added_tokens_decoder().values())
        added = sorted({t.content for t in added_tokens if len(t.content) > 1}, key=len)
        mode = classify(tokenizer)
        _scanner("regex" if mode == "regex" else "whitespace")  # built now, not mid-request
        return cls(
            spec=spec,
            json_bytes=json_bytes,
            chat_template=chat_template,
            bos_token=bos_token,
            eos_token=eos_token,
            max_model_len=max_model_len,
            mode=mode,
            appendable=appendable(tokenizer, mode),
            added=tuple(reversed(added)),
            added_firsts="".join(sorted({t[0] for t in added})),
            normalized_added=tokenizer.normalizer is not None
            and any(t.normalized for t in added_tokens),
            head=_measure_head(tokenizer),
            fast=build_fast_encoder(json_bytes, tokenizer, known_regexes=_KNOWN_REGEXES)
            if fast
            else None,
        )


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # The batch API releases the GIL; `encode` does not (tokenizers 0.23: 2 threads
    # encode at 1.7-2.2x one with encode_batch, at 0.7-0.85x with encode).
    batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    try:
        ids: list[int] = batch([text], add_special_tokens=add_special_tokens)[0].ids
    except TypeError:
        # JSON can carry lone surrogates ("\ud800"); Rust strings cannot.
        if any("\ud800" <= ch <= "\udfff" for ch in text):
            raise InvalidRequest("the text contains a lone surrogate: not valid Unicode") from None
        raise
    return ids


def _measure_head(tokenizer: Tokenizer) -> tuple[int, ...] | None:
    probe = "Hello world, this is a probe."
    plain = _encode(tokenizer, probe, False)
    special = _encode(tokenizer, probe, True)
    if not plain:
        return None
    for k in range(len(special) - len(plain) + 1):
        if special[k : k + len(plain)] == plain:
            return tuple(special[:k])
    return None


# -- one instance -------------------------------------------------------------------


class _Declined(Exception):
    """A prefix piece the fast encoder does not cover (``prefix_ids_fast``)."""


class LoadedTokenizer:
    """One tokenizer instance with its chat template and special tokens.

    Safe to share between threads (the Rust side locks), but pool threads should
    use their group's copy from :meth:`TokenizerRegistry.get`.
    """

    __slots__ = ("_cache_entries", "_density", "_encode_cut", "_info", "tokenizer")

    def __init__(
        self, info: _Info, tokenizer: Tokenizer, cache_entries: int = PREFIX_CACHE_SIZE
    ) -> None:
        self._info = info
        self.tokenizer = tokenizer
        # lru_cache is thread-safe; each copy (one per group of pool threads) has
        # its own, bounded by prepare.prefix_cache_entries pieces of a few KiB each.
        self._cache_entries = cache_entries
        self._encode_cut = functools.lru_cache(maxsize=cache_entries)(self._encode_tuple)
        #: UTF-8 bytes per token of the prefixes cut so far (threads race on it
        #: harmlessly: it only sizes the first piece, never changes an id)
        self._density = BYTES_PER_TOKEN

    def _encode_tuple(self, text: str) -> tuple[int, ...]:
        return tuple(self._encode_piece(text))

    def _encode_piece(self, text: str) -> list[int]:
        """``encode(text, add_special_tokens=False)``, through tiktoken where exact."""
        fast = self._info.fast
        if fast is not None:
            ids = fast.encode(text)
            if ids is not None:
                return ids
        return _encode(self.tokenizer, text, False)

    @property
    def fast_bpe(self) -> bool:
        """Whether prefix ids go through tiktoken (module documentation)."""
        return self._info.fast is not None

    def __repr__(self) -> str:
        return f"LoadedTokenizer({str(self._info.spec.tokenizer_file)!r})"

    def copy(self) -> LoadedTokenizer:
        """A new instance from the same JSON (its own word cache and lock)."""
        from tokenizers import Tokenizer

        return LoadedTokenizer(
            self._info, _prepare(Tokenizer.from_buffer(self._info.json_bytes)), self._cache_entries
        )

    @property
    def spec(self) -> TokenizerSpec:
        return self._info.spec

    @property
    def chat_template(self) -> str | None:
        return self._info.chat_template

    @property
    def bos_token(self) -> str | None:
        return self._info.bos_token

    @property
    def eos_token(self) -> str | None:
        return self._info.eos_token

    @property
    def max_model_len(self) -> int | None:
        return self._info.max_model_len

    @property
    def cut_mode(self) -> CutMode:
        """``regex``/``whitespace``: prefix cuts proven exact; ``checked``: verified."""
        return self._info.mode

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- encode / decode ----------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (through the batch API, which releases the GIL)."""
        return _encode(self.tokenizer, text, add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (through ``decode_batch``)."""
        texts: list[str] = self.tokenizer.decode_batch(
            [list(ids)], skip_special_tokens=skip_special_tokens
        )
        return texts[0]

    def token_strs(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary string of each id (``None`` for an unknown id)."""
        to_token = self.tokenizer.id_to_token
        return [to_token(i) for i in ids]

    def prefix_ids(self, text: str, n: int, *, add_special_tokens: bool = False) -> list[int]:
        """``encode(text)[:n]``, tokenizing only a safe prefix of ``text``.

        See the module documentation for why the result is exact.
        """
        if n <= 0:
            return []
        if add_special_tokens:
            head = self._info.head
            if head is None:  # a post-processor we could not measure: no shortcut
                return self.encode(text, add_special_tokens=True)[:n]
            if len(head) >= n:
                return list(head[:n])
            return list(head) + self.prefix_ids(text, n - len(head))
        if self._info.appendable:
            return self._continued_prefix(text, n)
        return self._restarted_prefix(text, n)

    def prefix_ids_fast(self, text: str, n: int) -> list[int] | None:
        """:meth:`prefix_ids` when tiktoken (or the piece cache) covers every piece.

        ``None`` when a piece would need ``tokenizers`` or the cuts must restart
        from 0: then the caller runs :meth:`prefix_ids` on the prepare pool. Bounded
        by ``n`` (a few hundred ids: tens of µs), it is cheap enough for an event
        loop, where the hop to a pool thread and back costs more than the encode.
        """
        fast = self._info.fast
        if fast is None or not self._info.appendable:
            return None
        if n <= 0:
            return []
        try:
            return self._continued_prefix(text, n, fast)
        except _Declined:
            return None

    def _continued_prefix(
        self, text: str, n: int, fast_only: FastEncoder | None = None
    ) -> list[int]:
        """Pieces between safe cuts, appended until there are ``n`` ids.

        :param fast_only: raise :class:`_Declined` at a piece this encoder does not cover.
        """
        ids: list[int] = []
        start = 0
        target = _aim(text, n * self._density * AIM_SLACK)
        pieces = 0
        while True:
            cut = self._find_cut(text, target)
            piece = text[start:] if cut is None else text[start:cut]
            if fast_only is not None and not fast_only.covers(piece):
                raise _Declined
            if cut is None:  # no safe cut past the aim: the rest, whole
                ids += self._encode_piece(piece)
                return ids[:n]
            ids += self._encode_cut(piece)
            if len(ids) >= n:
                self._learn(text, cut, len(ids))
                return ids[:n]
            pieces += 1
            # The ids still missing, at the density seen so far, and a little more.
            step = int((n - len(ids)) * cut / max(len(ids), 1) * CONTINUE_SLACK)
            step += CONTINUE_MARGIN
            if pieces >= CONTINUE_PIECES:
                step = max(step, cut)
            start, target = cut, cut + step

    def _learn(self, text: str, cut: int, count: int) -> None:
        """Move the learned bytes per token towards that of ``text[:cut]``."""
        size = cut if text.isascii() else len(text[:cut].encode("utf-8", "surrogatepass"))
        lo, hi = DENSITY_RANGE
        seen = min(max(size / count, lo), hi)
        self._density += DENSITY_WEIGHT * (seen - self._density)

    def _restarted_prefix(self, text: str, n: int) -> list[int]:
        """Longer cuts from 0 until one yields ``n`` ids (checked: and agrees)."""
        checked = self._info.mode == "checked"
        target = _aim(text, n * self._density * AIM_SLACK)
        previous: list[int] | None = None
        while True:
            cut = self._find_cut(text, target)
            if cut is None:
                return self._encode_piece(text)[:n]
            ids = list(self._encode_cut(text[:cut]))
            if len(ids) < n or (checked and len(ids) == n):
                target = 2 * cut
                continue
            if not checked:
                return ids[:n]
            # Not proven for this tokenizer: accept once a cut twice as far agrees.
            if previous is not None and previous[:n] == ids[:n]:
                return ids[:n]
            previous = ids
            target = 2 * cut

    def _find_cut(self, text: str, start: int) -> int | None:
        """The first safe cut at or after ``start``, or None (then: whole text)."""
        if start >= len(text):
            return None
        scan = _scanner("regex" if self._info.mode == "regex" else "whitespace")
        pos = max(start, 1)
        for _ in range(MAX_REJECTED_CUTS):
            match = scan.candidate.search(text, pos)
            if match is None:
                return None
            cut = match.start()
            ch, before = text[cut], text[cut - 1]
            if ch in CUT_WHITESPACE or not scan.proven_after_alnum:
                # Shape 1 (whitespace family: any whitespace after non-whitespace).
                ok = not before.isspace()
            else:
                # Shape 2: punctuation, a symbol or a newline after a letter or digit.
                ok = before.isalnum() and before not in scan.unstable
            if not ok:
                # The rest of a run of candidates only holds shape-1 cuts (whitespace
                # after punctuation); look for one in C, then jump past the run.
                run = scan.run.match(text, cut)
                end = run.end() if run is not None else cut + 1
                inner = _SPACE_AFTER_NON_SPACE.search(text, cut, end)
                if inner is None:
                    pos = end
                    continue
                cut = inner.start() + 1
            if not self._straddles(text, cut):
                return cut
            pos = cut + 1
        return None

    def _straddles(self, text: str, cut: int) -> bool:
        """Whether an added token occurs across ``cut`` (raw, or normalized)."""
        added = self._info.added
        if not added:
            return False
        longest = len(added[0])
        lo = max(0, cut - longest + 1)
        firsts = self._info.added_firsts
        if _occurs_across(text[lo : cut + longest - 1], cut - lo, added, firsts):
            return True
        normalizer = self.tokenizer.normalizer
        if self._info.normalized_added and normalizer is not None:
            # Normalized added tokens match the normalized text; the cut sits before
            # a character that never composes, so both sides normalize apart.
            reach = 4 * longest
            left = normalizer.normalize_str(text[max(0, cut - reach) : cut])
            right = normalizer.normalize_str(text[cut : cut + reach])
            return _occurs_across(left + right, len(left), added, firsts)
        return False

    # -- chat ------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
        budget: RenderBudget | None = None,
    ) -> str:
        """Render the chat template the way HF ``apply_chat_template`` does.

        :raises InvalidRequest: (400) without a chat template, or when rendering fails.
        """
        if self._info.chat_template is None:
            raise InvalidRequest("the model's tokenizer has no chat template", param="messages")
        from meshkit.prepare.templates import render_chat_template

        return render_chat_template(
            self._info.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self._info.bos_token,
            eos_token=self._info.eos_token,
            extra=extra,
            budget=budget,
        )


def _aim(text: str, size: float) -> int:
    """The characters of ``text`` holding about ``size`` UTF-8 bytes."""
    nbytes = int(size)
    window = text[:nbytes]
    if window.isascii():
        return nbytes
    size = len(window.encode("utf-8", "surrogatepass"))
    return max(1, nbytes * len(window) // size)


def _occurs_across(window: str, cut: int, tokens: Sequence[str], firsts: str) -> bool:
    head = window[:cut]
    # A token across the cut starts before it: without one of the tokens' first
    # characters there (Qwen's all start with "<"), no token needs looking for.
    if not any(ch in head for ch in firsts):
        return False
    for token in tokens:
        # An occurrence across the cut starts in (cut - len, cut): find the first
        # one from the lowest such start; any later start is past the cut.
        at = window.find(token, max(0, cut - len(token) + 1))
        if at != -1 and at < cut:
            return True
    return False


# -- the registry -------------------------------------------------------------------


class _Entry:
    __slots__ = ("copies", "lock")

    def __init__(self, base: LoadedTokenizer) -> None:
        self.copies: dict[int, LoadedTokenizer] = {0: base}
        self.lock = threading.Lock()


class TokenizerRegistry:
    """Tokenizers per model, one copy per group of ``workers_per_tokenizer`` threads.

    ``get(model)`` falls back to the default tokenizer (registered as ``None``)
    when the model has none of its own.
    """

    def __init__(
        self,
        *,
        workers_per_tokenizer: int = 4,
        workers: int | None = None,
        fast_tokenizer: bool = True,
        prefix_cache_entries: int = PREFIX_CACHE_SIZE,
    ) -> None:
        """
        :param workers_per_tokenizer: pool threads sharing one copy.
        :param prefix_cache_entries: prefix pieces each copy remembers
            (``prepare.prefix_cache_entries``).
        :param workers: when given, every copy those threads need is made at
            registration instead of on first use.
        :param fast_tokenizer: prefix ids through tiktoken where it is exact
            (``prepare.fast_tokenizer``; needs the ``fast`` extra).
        """
        if workers_per_tokenizer < 1:
            raise ConfigError("prepare.workers_per_tokenizer", "must be at least 1")
        self.workers_per_tokenizer = workers_per_tokenizer
        self.fast_tokenizer = fast_tokenizer
        self.prefix_cache_entries = prefix_cache_entries
        self._eager_groups = 0 if workers is None else -(-max(1, workers) // workers_per_tokenizer)
        self._entries: dict[str | None, _Entry] = {}
        self._lock = threading.Lock()

    def register(
        self, model: str | None, path: str | os.PathLike[str] | TokenizerSpec
    ) -> LoadedTokenizer:
        """Load a tokenizer for ``model`` (``None``: the default), replacing any other.

        :raises ConfigError: when the files are missing or invalid.
        """
        spec = path if isinstance(path, TokenizerSpec) else TokenizerSpec(path)
        base = spec.load(fast=self.fast_tokenizer, cache_entries=self.prefix_cache_entries)
        entry = _Entry(base)
        for group in range(1, self._eager_groups):
            entry.copies[group] = base.copy()
        with self._lock:
            self._entries[model] = entry
        return base

    def remove(self, model: str | None) -> bool:
        """Forget ``model``'s tokenizer and its copies; False if it had none."""
        with self._lock:
            return self._entries.pop(model, None) is not None

    def has_any(self) -> bool:
        return bool(self._entries)

    def models(self) -> list[str | None]:
        with self._lock:
            return list(self._entries)

    def get(self, model: str | None) -> LoadedTokenizer | None:
        """The calling thread's copy of ``model``'s tokenizer (or the default's)."""
        entries = self._entries
        entry = entries.get(model)
        if entry is None and model is not None:
            entry = entries.get(None)
        if entry is None:
            return None
        index = current_worker_index()
        group = 0 if index is None else index // self.workers_per_tokenizer
        found = entry.copies.get(group)
        if found is not None:
            return found
        with entry.lock:  # one thread of the group builds it; the others wait
            found = entry.copies.get(group)
            if found is None:
                found = entry.copies[0].copy()
                entry.copies[group] = found
        return found

    def copies(self, model: str | None) -> int:
        """How many instances exist for ``model`` (tests, memory accounting)."""
        entry = self._entries.get(model)
        return 0 if entry is None else len(entry.copies)
