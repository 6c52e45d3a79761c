"""Loading the target model (any Hugging Face causal LM) and its tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import CONFIG_ERRORS, draft_kind
from blockspec.models.quantized import check_quantize, quantize_target
from blockspec.tokens import encode_prompt, has_chat_template, is_chat, stop_token_ids


@dataclass
class Target:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the generation config and the tokenizer.

        The chat template's end-of-turn token is not added here: a chat model's generation
        config names it (the hub's conversion writes it there).
        """
        return tuple(stop_token_ids(self.tokenizer, self.model.generation_config, end_of_turn=False))

    def encode_prompt(self, prompt, use_chat_template: bool = True, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a prompt: a string, a list of chat messages (always through the chat
        template, with ``tools`` where given), or ids already. An empty prompt is an error."""
        chat = is_chat(prompt)
        if chat and not has_chat_template(self.tokenizer):
            raise BlockspecError(f"{self.name} has no chat template: pass plain text instead of chat messages")
        ids = encode_prompt(self.tokenizer, prompt, use_chat_template=use_chat_template or chat, tools=tools)
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise BlockspecError("the prompt is empty: give some text to continue")
        return ids


def layer_features(hidden_states, layer_ids) -> torch.Tensor:
    """The outputs of target layers ``layer_ids`` (``hidden_states[i + 1]``), concatenated: [B, T, len * D].

    Every family's ``hidden_states`` is the embedding output (Gemma's scaled, as its layers see it),
    then each decoder layer's output, the last one after the final norm.
    """
    if max(layer_ids) + 1 >= len(hidden_states):
        raise BlockspecError(f"the drafter reads target layer {max(layer_ids)} but the target returned hidden states "
                             f"of {len(hidden_states) - 1} layers: use a drafter made for this target")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def forward_options(model) -> dict:
    """Keyword arguments of every target forward of decoding: MoE router outputs off (they are only a
    training loss's, and would be computed over the verify masks)."""
    config = model.config.get_text_config(decoder=True)
    return {"output_router_logits": False} if getattr(config, "output_router_logits", False) else {}


def position_ids(start: int, length: int, device) -> torch.LongTensor:
    """Position ids [1, length] starting at ``start``."""
    return torch.arange(start, start + length, device=device).unsqueeze(0)


def copy_final_norm(norm, target_model) -> None:
    """Start a draft's final norm at the target's output norm (its hidden states meet the target's LM head)."""
    weight = getattr(getattr(target_model.base_model, "norm", None), "weight", None)
    if weight is not None and weight.shape == norm.weight.shape:
        with torch.no_grad():
            norm.weight.copy_(weight.detach().float())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 is not faster there), bf16 on CUDA."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_path(name_or_path: str) -> str:
    """A local directory as is, a known model name prepared offline, else a hub name."""
    from blockspec import hub

    return hub.resolve_model(name_or_path)


def load_target(name_or_path: str, device: str | None = None, dtype: str | torch.dtype | None = None,
                *, role: str = "target", quantize: str | None = None) -> Target:
    """Load a causal LM and its tokenizer from a local directory (or a hub name when online).

    ``role`` names the model in error messages ("target", or "draft" for a draft model);
    ``quantize``: "fp16" runs the linear layers on fp16 weights (``models.quantized``).
    """
    check_quantize(quantize)  # before the weights load
    path = resolve_path(str(name_or_path))
    _check_model_dir(path)
    dev = torch.device(device) if device else default_device()
    torch_dtype = parse_dtype(dtype) if dtype else default_dtype(dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError, *CONFIG_ERRORS) as error:
        raise BlockspecError(f"could not load the {role} model from {path}: {error}") from error
    model.to(dev).eval()
    model.requires_grad_(False)
    quantize_target(model, quantize)
    return Target(model=model, tokenizer=tokenizer, name=str(name_or_path))


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise BlockspecError(f"unknown dtype {dtype!r}: use one of {', '.join(names)}")
    return names[dtype]


def _check_model_dir(path: str) -> None:
    directory = Path(path)
    if not directory.exists():
        if _names_a_directory(path):
            raise BlockspecError(f"the model directory {path} does not exist: check the path, or give a known name "
                                 "(`blockspec models` lists them)")
        return  # a hub name; transformers reports what is wrong with it
    config = directory / "config.json"
    if not config.is_file():
        raise BlockspecError(f"{directory} is not a model directory: config.json is missing")
    try:
        settings = json.loads(config.read_text())
    except json.JSONDecodeError as error:
        raise BlockspecError(f"{config} is not valid JSON ({error}): re-save the model") from error
    draft = draft_kind(settings) if isinstance(settings, dict) else None
    if draft is not None:
        raise BlockspecError(f"{directory} is {draft} checkpoint, not a model to decode: pass it as --draft, and give "
                             "the model it drafts for as --target")


def _names_a_directory(path: str) -> bool:
    """Whether ``path`` can only be a directory, not a hub name (namespace/name: one slash, no leading dot)."""
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path
