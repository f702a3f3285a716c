"""Loading tokenizers from local files, and the per-group copies of the registry."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from meshkit.errors import ConfigError
from meshkit.prepare.pool import PreparePool, current_worker_index
from meshkit.prepare.tokenizers import LoadedTokenizer, TokenizerRegistry, TokenizerSpec

T = TypeVar("T")


def _copy_tiny(tiny_dir: Path, dest: Path, **config_changes: object) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny_dir / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


# -- TokenizerSpec -----------------------------------------------------------------


def test_spec_loads_a_directory_or_the_file(tiny_dir: Path) -> None:
    from_dir = TokenizerSpec(tiny_dir).load()
    from_file = TokenizerSpec(str(tiny_dir / "tokenizer.json")).load()
    text = "the quick brown fox"
    assert from_dir.encode(text, add_special_tokens=False) == from_file.encode(
        text, add_special_tokens=False
    )
    assert from_dir.max_model_len == 2048
    assert TokenizerSpec(tiny_dir, max_model_len=77).load().max_model_len == 77


def test_special_tokens_as_strings_or_dicts(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy_tiny(tiny_dir, tmp_path, bos_token="<s>", eos_token={"content": "</s>"})
    tok = TokenizerSpec(path).load()
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")


def test_chat_template_sources(tiny_dir: Path, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    with_names = _copy_tiny(tiny_dir, tmp_path / "a", chat_template=named)
    assert TokenizerSpec(with_names).load().chat_template == "D"
    apart = _copy_tiny(tiny_dir, tmp_path / "b", chat_template=None)
    assert TokenizerSpec(apart).load().chat_template is None
    (apart / "chat_template.jinja").write_text("J")
    assert TokenizerSpec(apart).load().chat_template == "J"


def test_no_config_file_is_fine(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = TokenizerSpec(tmp_path).load()
    assert tok.chat_template is None and tok.bos_token is None and tok.max_model_len is None


def test_huge_model_max_length_means_unknown(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy_tiny(tiny_dir, tmp_path, model_max_length=1e30)
    assert TokenizerSpec(path).load().max_model_len is None


@pytest.mark.parametrize("content", [None, "not json"])
def test_missing_or_broken_files_are_config_errors(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ConfigError) as info:
        TokenizerSpec(tmp_path).load()
    assert info.value.key == "tokenizer"


def test_truncation_and_padding_in_the_file_are_switched_off(
    tiny_dir: Path, tmp_path: Path
) -> None:
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    data["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    tok = TokenizerSpec(tmp_path).load()
    assert len(tok.encode("the quick brown fox jumps over", add_special_tokens=False)) > 4
    assert len(tok.copy().encode("the quick brown fox jumps", add_special_tokens=False)) > 4


def test_encode_decode_round_trip(tiny: LoadedTokenizer) -> None:
    text = "the quick brown fox 的一是 def f(x):"
    ids = tiny.encode(text, add_special_tokens=False)
    assert tiny.decode(ids) == text
    with_bos = tiny.encode(text, add_special_tokens=True)
    assert with_bos[1:] == ids
    assert tiny.decode(with_bos) == "<s>" + text
    assert tiny.decode(with_bos, skip_special_tokens=True) == text
    assert tiny.token_strs(ids[:2]) == [tiny.tokenizer.id_to_token(i) for i in ids[:2]]


# -- the registry ------------------------------------------------------------------


def test_default_and_per_model_lookup(tiny_dir: Path) -> None:
    registry = TokenizerRegistry()
    assert registry.get(None) is None and not registry.has_any()
    default = registry.register(None, tiny_dir)
    assert registry.get("any-model") is default  # falls back to the default
    own = registry.register("m", TokenizerSpec(tiny_dir))
    assert registry.get("m") is own
    assert registry.remove("m") and not registry.remove("m")
    assert registry.get("m") is default
    assert registry.remove(None)
    assert registry.get("m") is None
    assert sorted(map(str, registry.models())) == []


def _per_worker(pool: PreparePool, fn: Callable[[], T]) -> dict[int, T]:
    """Run ``fn`` once on every worker thread (a barrier keeps them apart)."""
    barrier = threading.Barrier(pool.workers)
    results: dict[int, T] = {}
    lock = threading.Lock()

    def job() -> None:
        barrier.wait(10)
        index = current_worker_index()
        assert index is not None
        value = fn()
        with lock:
            results[index] = value

    jobs = [pool.submit(job) for _ in range(pool.workers)]
    for job_ in jobs:
        job_.result()
    return results


def test_copies_per_group_of_workers(tiny_dir: Path, make_pool: Callable[..., PreparePool]) -> None:
    pool = make_pool(workers=4)
    registry = TokenizerRegistry(workers_per_tokenizer=2)
    registry.register("m", tiny_dir)
    seen = _per_worker(pool, lambda: registry.get("m"))
    assert seen[0] is seen[1]
    assert seen[2] is seen[3]
    assert seen[0] is not seen[2]
    assert registry.copies("m") == 2
    assert registry.get("m") is seen[0]  # outside the pool: group 0's copy
    text = "the lazy dog"
    encodings = {tuple(t.encode(text, add_special_tokens=False)) for t in seen.values() if t}
    assert len(encodings) == 1

    # Re-registering replaces every copy; removing drops them.
    registry.register("m", tiny_dir)
    again = _per_worker(pool, lambda: registry.get("m"))
    assert not {id(t) for t in again.values()} & {id(t) for t in seen.values()}
    assert again[0] is again[1] and again[0] is not again[2]
    registry.remove("m")
    assert registry.copies("m") == 0
    assert set(_per_worker(pool, lambda: registry.get("m")).values()) == {None}


def test_eager_copies(tiny_dir: Path) -> None:
    registry = TokenizerRegistry(workers_per_tokenizer=4, workers=9)
    registry.register(None, tiny_dir)
    assert registry.copies(None) == 3


def test_invalid_group_size() -> None:
    with pytest.raises(ConfigError):
        TokenizerRegistry(workers_per_tokenizer=0)
