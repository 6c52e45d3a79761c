"""Masked-diffusion models behind one small protocol: logits for every position.

A masked diffusion LM sees a sequence in which some tokens are MASK and predicts all of
them at once. Three kinds of checkpoint fit the protocol:

- any Hugging Face causal LM run with bidirectional (or block-causal) attention: a 4D
  additive float mask [B, 1, Q, K] is passed through the model's attention interface,
  which transformers 5.x (Llama, Qwen2, Qwen3) uses as it is, for eager and SDPA alike;
- a causal LM adapted here (``blockspec dllm train``), which records its mask token, its
  attention and whether its logits are shifted in ``config.dllm``;
- LLaDA and Dream checkpoints, whose modelling code ships with the checkpoint: they load
  through ``AutoModel(trust_remote_code=True)`` and only when the user asks for that; both
  name their mask token ``mask_token_id`` in config.json (model_type "llada" / "Dream").

Shifted logits: a model initialised from an AR model (Dream, our adaptation) keeps its
habit of predicting the NEXT token, so the prediction for position i is read at i-1 (in
block-causal mode the first position of a block reads the previous block's last clean
position; see ``blockspec.dllm.train``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError
from transformers import DynamicCache

from blockspec.errors import BlockspecError

BIDIRECTIONAL = "bidirectional"
BLOCK_CAUSAL = "block_causal"
ATTENTION_MODES = (BIDIRECTIONAL, BLOCK_CAUSAL)

#: Model types whose modelling code comes with the checkpoint.
REMOTE_CODE_TYPES = {"llada": False, "dream": True}  # model_type -> shifted logits


class MaskedDiffusionModel(Protocol):
    """What a sampler needs from a model."""

    mask_token_id: int
    shifted: bool  # position i predicts token i+1
    supports_cache: bool
    vocab_size: int
    device: torch.device

    def logits(self, input_ids: torch.LongTensor, *, position_ids: torch.LongTensor,
               attention_mask: torch.Tensor | None, cache: DynamicCache | None = None,
               keep: torch.LongTensor | None = None) -> torch.Tensor:
        """Logits [B, Q or len(keep), V] of the fed positions.

        attention_mask: [B, 1, Q, K] bool, True = visible; K covers the cache then the fed ids.
        cache: keys/values of earlier positions; the fed positions are appended to it.
        keep: indices (into the fed positions) whose logits are wanted; None = all.
        """


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive float mask attention layers add to scores."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)


# ---------------------------------------------------------------------------
# Block-causal attention (block diffusion, BD3-LM)
# ---------------------------------------------------------------------------
# The prompt is block 0; the answer is cut into blocks of S positions from its first token
# (block 1 = the answer's first S tokens, ...). Training and sampling share this layout.

def answer_blocks(prompt_lengths: torch.Tensor, length: int, block_size: int) -> torch.LongTensor:
    """[B, L] block index of every position: 0 in the prompt, 1 + (i - prompt_length) // S after it."""
    positions = torch.arange(length, device=prompt_lengths.device)[None, :]
    offset = positions - prompt_lengths[:, None]
    return torch.where(offset < 0, 0, 1 + torch.div(offset, block_size, rounding_mode="floor"))


def block_causal_mask(query_blocks: torch.Tensor, key_blocks: torch.Tensor) -> torch.Tensor:
    """[..., Q, K] bool, True = visible: a query sees every key whose block is not after its own.

    This is the mask of inference: the block being denoised sees itself (bidirectionally)
    and the clean blocks before it (fed before, or kept in the KV cache).
    """
    return key_blocks[..., None, :] <= query_blocks[..., :, None]


def block_diffusion_training_mask(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 2L, 2L] bool visibility of the doubled training sequence [x_t ; x_0], True = visible,
    from the block index [..., L] of each position.

    Rows and columns 0..L-1 are the noisy copy x_t, L..2L-1 the clean copy x_0, both at the
    positions 0..L-1. Noisy block b sees noisy block b (bidirectionally) and clean blocks < b;
    clean block b sees clean blocks <= b and nothing noisy. One forward thus trains every block
    to be denoised from the clean blocks before it, as at inference.
    """
    query, key = blocks[..., :, None], blocks[..., None, :]
    noisy_rows = torch.cat([key == query, key < query], dim=-1)
    clean_rows = torch.cat([torch.zeros_like(key == query), key <= query], dim=-1)
    return torch.cat([noisy_rows, clean_rows], dim=-2)


@dataclass
class HFDiffusionModel:
    """A Hugging Face causal LM run as a masked diffusion model (with the caller's mask, not the causal one).

    ``attention`` and ``block_size`` say how it was trained (``config.dllm``): bidirectional
    over the whole sequence, or block-causal with blocks of ``block_size`` positions.
    """

    model: torch.nn.Module
    mask_token_id: int
    shifted: bool = False
    supports_cache: bool = True
    attention: str = BIDIRECTIONAL
    block_size: int | None = None

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def logits(self, input_ids, *, position_ids, attention_mask, cache=None, keep=None):
        dtype = next(self.model.parameters()).dtype
        mask = None if attention_mask is None else additive_mask(attention_mask, dtype)
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                                       cache=cache, use_cache=cache is not None).last_hidden_state
        if keep is not None:
            hidden = hidden[:, keep]
        return self.model.get_output_embeddings()(hidden).float()


@dataclass
class RemoteCodeDiffusionModel:
    """A LLaDA or Dream checkpoint with its own modelling code: full forwards only."""

    model: torch.nn.Module
    mask_token_id: int
    shifted: bool
    supports_cache: bool = False

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logits(self, input_ids, *, position_ids, attention_mask, cache=None, keep=None):
        if cache is not None:
            raise BlockspecError("this checkpoint's own modelling code has no KV cache here: use --sampler llada "
                                 "or dream (no prefix/dual/exact cache)")
        padding = None
        if attention_mask is not None and not bool(attention_mask.all()):
            padding = attention_mask[:, 0].any(dim=1).long()  # keys anyone may see: the non-pad ones
        logits = self.model(input_ids=input_ids, attention_mask=padding).logits
        if keep is not None:
            logits = logits[:, keep]
        return logits.float()


# ---------------------------------------------------------------------------
# Loading by path
# ---------------------------------------------------------------------------

def diffusion_settings(config) -> dict:
    """The ``dllm`` dict an adapted checkpoint carries in its config (empty if none)."""
    value = getattr(config, "dllm", None) if not isinstance(config, dict) else config.get("dllm")
    return dict(value or {})


def needs_remote_code(config: dict) -> bool:
    model_type = str(config.get("model_type", "")).lower()
    return model_type in REMOTE_CODE_TYPES or bool(config.get("auto_map"))


def load_diffusion_model(path: str, *, trust_remote_code: bool = False, device: str | None = None,
                         dtype: str | torch.dtype | None = None, mask_token_id: int | None = None,
                         shifted: bool | None = None):
    """A masked diffusion model and its tokenizer from a checkpoint directory.

    LLaDA / Dream checkpoints run their own code, so they load only with
    ``trust_remote_code=True``; their mask token is ``mask_token_id`` in their config.json
    (126336 for LLaDA, 151666 for Dream). Any other causal LM runs through its HF class with
    the sampler's attention mask; its mask token comes from ``config.dllm`` (adapted by
    ``blockspec dllm train``, which also records shifted / attention / block_size there) or
    ``config.mask_token_id``. ``mask_token_id`` and ``shifted`` override what the config says.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from blockspec.models.target import default_device, default_dtype, parse_dtype, resolve_path

    directory = resolve_path(str(path))
    config = _read_config(directory)
    remote = needs_remote_code(config)
    if remote and not trust_remote_code:
        raise BlockspecError(
            f"{path} is a {config.get('model_type') or 'custom'} checkpoint that runs its own modelling code: "
            "pass --trust-remote-code (trust_remote_code=True) if you trust its author")
    settings = diffusion_settings(config)
    mask_id = _mask_token_id(config, mask_token_id, path)
    _check_mask_token(mask_id, config, path)
    dev = torch.device(device) if device else default_device()
    torch_dtype = parse_dtype(dtype) if dtype else default_dtype(dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
        if remote:
            model = AutoModel.from_pretrained(directory, dtype=torch_dtype, trust_remote_code=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype)
    except (OSError, ValueError, SafetensorError) as error:
        raise BlockspecError(f"could not load the diffusion model from {directory}: {error}") from error
    model.to(dev).eval().requires_grad_(False)
    if remote:
        default_shift = REMOTE_CODE_TYPES.get(str(config.get("model_type", "")).lower(), False)
        wrapped = RemoteCodeDiffusionModel(model, mask_id, default_shift if shifted is None else shifted)
    else:
        shift = settings.get("shifted", False) if shifted is None else shifted
        wrapped = HFDiffusionModel(model, mask_id, bool(shift), attention=settings.get("attention", BIDIRECTIONAL),
                                   block_size=settings.get("block_size"))
    return wrapped, tokenizer


def config_mask_token_id(config: dict) -> int | None:
    """The mask token a checkpoint's config.json names: ``dllm.mask_token_id`` (adapted here),
    else ``mask_token_id`` (LLaDA: 126336, Dream: 151666; None when it names none)."""
    value = diffusion_settings(config).get("mask_token_id", config.get("mask_token_id"))
    return None if value is None else int(value)


def _mask_token_id(config: dict, given: int | None, path) -> int:
    value = given if given is not None else config_mask_token_id(config)
    if value is not None:
        return int(value)
    raise BlockspecError(f"{path} names no mask token (config.json has no mask_token_id or dllm.mask_token_id): "
                         "pass --mask-token-id, or adapt the model first with `blockspec dllm train`")


def _check_mask_token(mask_id: int, config: dict, path) -> None:
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and not 0 <= mask_id < vocab:
        raise BlockspecError(f"mask token id {mask_id} lies outside the vocabulary of {path} (0..{vocab - 1})")


def _read_config(directory: str) -> dict:
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise BlockspecError(f"{directory} is not a model directory: config.json is missing")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise BlockspecError(f"{config_path} is not valid JSON ({error})") from error
