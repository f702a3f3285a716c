"""Regenerate ``src/meshkit/demo/tokenizer/tokenizer.json`` and its ``tokenizer_config.json``.

A byte-level BPE (GPT-2 pre-tokenizer regex, NFC, a BOS added by the
post-processor) trained on a few hundred generated lines: small enough to commit
and to load in milliseconds, shaped like the real ones. Run from anywhere::

    python tests/prepare/data/make_tiny_tokenizer.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

HERE = Path(__file__).resolve().parents[3] / "src" / "meshkit" / "demo" / "tokenizer"
SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "router", "worker"),
    *("prompt", "token", "cache", "prefix", "hash", "model", "request", "response", "stream"),
    *("chat", "message", "system", "user", "assistant", "tool", "call", "def", "return"),
    *("import", "class", "self", "print", "value", "list", "dict", "string", "number"),
]
CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message.role) }}"
    "{% endif %}"
    "<|{{ message.role }}|>\n{{ message.content }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def lines(rng: random.Random, count: int) -> list[str]:
    out = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.6:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) + ".")
        elif kind < 0.8:
            out.append("".join(rng.choice(CJK) for _ in range(rng.randint(4, 20))) + "。")
        else:
            name = rng.choice(WORDS)
            out.append(f"def {name}(x, y=1):\n    return x + {rng.randint(0, 999)}  # {name}")
    return out


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines(random.Random(0), 400), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    HERE.mkdir(exist_ok=True)
    tok.save(str(HERE / "tokenizer.json"), pretty=False)
    config = {
        "bos_token": {"content": "<s>", "lstrip": False, "rstrip": False, "special": True},
        "eos_token": "</s>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
