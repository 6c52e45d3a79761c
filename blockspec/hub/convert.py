"""Converting a GGUF file once into a dense float32 Hugging Face checkpoint (needs torch and transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from blockspec.errors import BlockspecError
from blockspec.hub.progress import library_progress_bars
from blockspec.tokens import stop_token_ids


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Dequantise a GGUF file into a dense float32 checkpoint in `out_dir`.

    Returns facts for the marker (library versions, end-of-turn token ids).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with library_progress_bars(progress):
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        detach_gguf_quantizer(model)
        eos_ids = eos_token_ids(model, tokenizer)
        model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(out_dir)
    return {
        "eos_token_ids": eos_ids,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }


def detach_gguf_quantizer(model: Any) -> None:
    """Make a model loaded from GGUF saveable as a plain dense checkpoint.

    transformers dequantises llama/qwen2 GGUF files into ordinary layers but leaves the
    GGUF quantizer attached (`model.hf_quantizer`, `model.quantization_method`,
    `model.is_quantized`, `config.quantization_config`, `config._is_quantized`), and
    `save_pretrained` refuses a model whose quantizer is not serialisable.
    """
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
    if packed:
        raise BlockspecError(f"the model still holds packed GGUF layers ({', '.join(packed)})")
    for attribute in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    model.is_quantized = False
    for attribute in ("quantization_config", "_is_quantized"):
        if attribute in vars(model.config):
            delattr(model.config, attribute)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """What ends a response of the converted model, written into its generation config: the
    generation config's and the tokenizer's eos and the chat template's end-of-turn tokens."""
    ids = stop_token_ids(tokenizer, model.generation_config)
    if not ids:
        raise BlockspecError("the converted model has no end-of-sequence token")
    return ids


def _check_saved_tokenizer(out_dir: Path) -> None:
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if not reloaded.chat_template:
        raise BlockspecError(f"the tokenizer saved in {out_dir} lost its chat template")
