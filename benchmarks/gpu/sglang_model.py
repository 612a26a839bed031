"""A model directory SGLang serves with `--load-format dummy` (random weights, nothing downloaded):
a Llama config.json and a word-level tokenizer of the model's whole vocabulary, written here.

SGLang's server and its benchmark client both load a tokenizer from the model directory (the
client's `random-ids` dataset draws ids below `tokenizer.vocab_size`; the server detokenizes what it
streams back). A real tokenizer would have to be downloaded; the one written here maps id i to the
word `t<i>` (split on spaces), so any id the model emits decodes, and the client sends token ids
(`--tokenize-prompt`), so prompt lengths are exact.

    python -m benchmarks.gpu.sglang_model DIR [--shape 8b|tiny]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu.harness import LLAMA3_8B, Shape

__all__ = ["SMOKE_SHAPE", "llama_config", "routed_range", "write_model_dir"]

SMOKE_SHAPE = Shape(64, 96, 4, 2, 4, 512, (2, 3))  # --smoke: seconds on a CPU (the vocab fits 4 KB prompts)


def llama_config(s: Shape, dtype: str) -> dict:
    """A LlamaForCausalLM config.json of shape `s` (Llama-3's RoPE base, norms and token ids where the
    vocab holds them)."""
    bos, eos = (128000, 128001) if s.vocab > 128001 else (1, 2)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "num_hidden_layers": s.layers, "vocab_size": s.vocab,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "torch_dtype": dtype, "bos_token_id": bos, "eos_token_id": eos}


def routed_range(num_layers: int) -> str:
    """The layers a synthetic skipper routes: the upper half, as a VSKIPPER_SKIPPER range ("16-31" of 32)."""
    if num_layers < 2:
        raise ValueError(f"routed_range: num_layers={num_layers} must be >= 2")
    return f"{num_layers // 2}-{num_layers - 1}"


def write_model_dir(path: Path, s: Shape = LLAMA3_8B, dtype: str = "bfloat16") -> Path:
    """Write config.json and the word-level tokenizer (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json) into `path`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"write_model_dir: dtype={dtype!r} must be bfloat16, float16 or float32")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(s, dtype)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    words = {f"t{i}": i for i in range(s.vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token=f"t{cfg['bos_token_id']}",
                                   eos_token=f"t{cfg['eos_token_id']}", model_max_length=cfg["max_position_embeddings"])
    fast.save_pretrained(str(path))
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.sglang_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    args = ap.parse_args(argv)
    s, dtype = (LLAMA3_8B, "bfloat16") if args.shape == "8b" else (SMOKE_SHAPE, "float32")
    print(write_model_dir(args.dir, s, dtype))


if __name__ == "__main__":
    main()
