"""Write a tiny random-weight Llama for a real vLLM: ``python tiny_llama.py TOKENIZER DIR``.

Run as a script by the vLLM environment's interpreter (it needs torch and
transformers, which meshkit does not depend on; :mod:`meshkit.testing.vllm` runs
it). The tokenizer is given (meshkit's tests use ``tests/prepare/data/tiny``, a
420-token BPE with a chat template), so meshkit renders and tokenizes a chat
exactly as the engine does and its KV-event keys match. The weights are random
(seeded): the engine's answers are noise, its cache and its events are real.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main(tokenizer: Path, out: Path) -> None:
    import torch  # type: ignore[import-not-found]  # the vLLM environment has it
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())
    by_text = {**vocab["model"]["vocab"], **{t["content"]: t["id"] for t in vocab["added_tokens"]}}
    # transformers 5 takes a special token as a string (or a tagged AddedToken),
    # not the untagged map older releases wrote: the same token either way.
    conf = json.loads((tokenizer / "tokenizer_config.json").read_text())
    for key, value in list(conf.items()):
        if key.endswith("_token") and isinstance(value, dict):
            conf[key] = value["content"]
    config = LlamaConfig(
        vocab_size=max(512, max(by_text.values()) + 1),
        hidden_size=128,  # two heads of 64: vLLM's CPU attention has kernels from 32 up
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        bos_token_id=by_text.get(conf.get("bos_token", "")),
        eos_token_id=by_text.get(conf.get("eos_token", "")),
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    shutil.copy(tokenizer / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
