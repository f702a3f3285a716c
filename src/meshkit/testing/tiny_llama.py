"""Write a tiny random-weight Llama for a real vLLM: ``python tiny_llama.py TOKENIZER DIR``
(and ``--lora NAME=DIR ...``: a random LoRA adapter of it per name, in PEFT's layout).

Run as a script by the vLLM environment's interpreter (it needs torch and
transformers, which meshkit does not depend on; :mod:`meshkit.testing.vllm` runs
it). The tokenizer is given (meshkit's tests use :data:`meshkit.demo.TOKENIZER`, a
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


def lora(out: Path, rank: int = 8) -> None:
    """A random LoRA adapter of the model above (q_proj and v_proj of each layer), as
    PEFT saves one: vLLM's ``--lora-modules NAME=DIR`` loads it."""
    import torch
    from safetensors.torch import save_file  # type: ignore[import-not-found]

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            at = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{at}.lora_A.weight"] = torch.randn(rank, 128) * 0.01
            tensors[f"{at}.lora_B.weight"] = torch.randn(128, rank) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    for spec in sys.argv[4:] if sys.argv[3:4] == ["--lora"] else ():
        lora(Path(spec.split("=", 1)[1]))
