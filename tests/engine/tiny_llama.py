"""Write a tiny random-weight Llama for a real vLLM: ``python tiny_llama.py DIR``.

Run by the vLLM environment's interpreter (it needs torch and transformers, which
meshkit's test extras do not have). The tokenizer is the test one
(``tests/prepare/data/tiny``, a 420-token BPE with a chat template), so meshkit
renders and tokenizes a chat exactly as the engine does and its KV-event keys
match. The weights are random (seeded): the engine's answers are noise, its cache
and its events are real.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TOKENIZER = Path(__file__).resolve().parents[1] / "prepare" / "data" / "tiny"


def main(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((TOKENIZER / "tokenizer.json").read_text())
    ids = [*vocab["model"]["vocab"].values(), *(t["id"] for t in vocab["added_tokens"])]
    config = LlamaConfig(
        vocab_size=max(512, max(ids) + 1),
        hidden_size=128,  # two heads of 64: vLLM's CPU attention has kernels from 32 up
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,  # <s>
        eos_token_id=1,  # </s>
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    shutil.copy(TOKENIZER / "tokenizer.json", out / "tokenizer.json")
    # transformers 5 takes a special token as a string (or a tagged AddedToken),
    # not the untagged map older releases wrote: the same token either way.
    conf = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    for key, value in list(conf.items()):
        if key.endswith("_token") and isinstance(value, dict):
            conf[key] = value["content"]
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
