"""``meshkit demo``: mock workers, a gateway and real SDK traffic, all on loopback."""

from __future__ import annotations

from pathlib import Path

#: The demo's tokenizer: a 420-token byte-level BPE with a chat template (its mock
#: engines tokenize with it, as the routers do, so their KV-event keys match).
#: meshkit's tests and benchmarks use it too; regenerate it with
#: ``tests/prepare/data/make_tiny_tokenizer.py``.
TOKENIZER = Path(__file__).parent / "tokenizer"

from meshkit.demo.run import run_demo  # noqa: E402  (after TOKENIZER: run reads it)

__all__ = ["TOKENIZER", "run_demo"]
