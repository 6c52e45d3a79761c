"""Training masked diffusion LMs, and adapting an AR model into one (Dream-style).

The loss (LLaDA, MDLM): draw a rate t in [eps, 1] per sequence, replace each maskable token
with MASK with probability t, and take the cross-entropy of the model's predictions on the
masked tokens, each weighted 1/t. Normalisation follows LLaDA: pre-training divides the sum
by the number of tokens (batch x length); SFT (the prompt is never masked) divides each
sequence's sum by its response length, then averages over the batch.

Adaptation from an AR model (Dream): start from the AR weights, replace the causal mask by
the diffusion one, and keep the AR habit of predicting the NEXT token (shifted logits).

Two attentions:

- ``bidirectional``: every token sees every token (LLaDA, Dream).
- ``block_causal`` (block diffusion, BD3-LM): the prompt is block 0 and the response is cut
  into blocks of ``block_size`` positions from its first token (``answer_blocks``); block b is
  denoised from the CLEAN blocks before it, as at inference, where finished blocks sit in
  the KV cache. Training runs the doubled sequence [x_t ; x_0] in one forward with
  ``block_diffusion_training_mask``; the loss covers the masked tokens of the noisy copy.

Which hidden state predicts token i (``prediction_source``):

- not shifted: the hidden state of position i (in the noisy copy).
- shifted, bidirectional: the hidden state of position i-1; token 0 is never masked.
- shifted, block_causal: inside a block, the noisy copy's hidden state of i-1; for the first
  token of a block b > 0, the CLEAN copy's hidden state of i-1, the last token of block
  b-1 seen with clean blocks <= b-1 only. At inference that is the hidden state the forward
  that commits block b-1 computes (the one that writes its exact KV cache); it does not
  change while block b is denoised.

Checkpoints (``OUT/checkpoints/step-N``) are ``save_pretrained`` directories plus the
optimizer, scheduler and RNG state; a resumed run continues exactly. The model saved at
the end (``OUT/model``) carries a ``dllm`` entry in its config (see ``diffusion_settings``)
that ``load_diffusion_model`` reads.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError

from blockspec.dllm.model import (
    ATTENTION_MODES,
    BIDIRECTIONAL,
    BLOCK_CAUSAL,
    additive_mask,
    answer_blocks,
    block_diffusion_training_mask,
    diffusion_settings,
)
from blockspec.errors import BlockspecError
from blockspec.io import make_output_dir
from blockspec.models.checkpoint import load_pretrained_strict
from blockspec.tokens import encode_prompt, pick_mask_token, response_end_id
from blockspec.training.checkpoints import KEEP_CHECKPOINTS, saved_checkpoints
from blockspec.training.loop import (
    SampleOrder,
    StepResult,
    TrainingLoop,
    TrainState,
    check_at_least,
    check_positive,
    check_seed,
)
from blockspec.training.prompts import load_prompts
from blockspec.training.responses import given_response_ids
from blockspec.training.samples import TrainingSample, load_samples, make_sample, pad_batch

DEFAULT_EPS = 1e-3


# ---------------------------------------------------------------------------
# The forward process and the loss
# ---------------------------------------------------------------------------

@dataclass
class TokenBatch:
    input_ids: torch.LongTensor
    valid: torch.BoolTensor  # not padding
    response_mask: torch.BoolTensor
    position_ids: torch.LongTensor


@dataclass
class NoisedBatch:
    noisy_ids: torch.LongTensor  # [B, L] with MASK where masked
    masked: torch.BoolTensor  # [B, L]
    p_mask: torch.Tensor  # [B], the rate t of each sequence


def sample_mask_rates(batch: int, *, eps: float = DEFAULT_EPS, generator: torch.Generator | None = None):
    """One rate t in [eps, 1] per sequence, stratified over the batch (t_i = (u + i/B) mod 1):
    each t is still uniform, but the batch covers [0, 1] evenly, which steadies the 1/t-weighted loss."""
    u = torch.rand(1, generator=generator)
    t = (u + torch.arange(batch) / batch) % 1.0
    return (1 - eps) * t + eps


def add_mask_noise(input_ids: torch.LongTensor, maskable: torch.BoolTensor, mask_token_id: int, *,
                   eps: float = DEFAULT_EPS, generator: torch.Generator | None = None) -> NoisedBatch:
    """The forward process: each maskable token becomes MASK with its sequence's probability t."""
    batch, length = input_ids.shape
    p_mask = sample_mask_rates(batch, eps=eps, generator=generator)
    draws = torch.rand(batch, length, generator=generator)
    masked = (draws < p_mask[:, None]).to(input_ids.device) & maskable
    noisy = torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)
    return NoisedBatch(noisy, masked, p_mask.to(input_ids.device))


def masked_diffusion_loss(logits: torch.Tensor, targets: torch.LongTensor, masked: torch.BoolTensor,
                          p_mask: torch.Tensor, *, response_lengths: torch.Tensor | None = None,
                          total_tokens: int | None = None) -> torch.Tensor:
    """Cross-entropy on the masked tokens weighted 1/t, normalised like LLaDA.

    logits: [B, L, V] (the prediction for each position) or [N, V] for the masked positions
    only, in ``masked.nonzero()`` order. With ``response_lengths`` (SFT) each sequence's sum
    is divided by its response length and the batch averaged; otherwise the sum is divided
    by ``total_tokens`` (default B x L; the number of real tokens when there is padding).
    """
    rows = masked.nonzero(as_tuple=True)[0]
    picked = logits[masked] if logits.dim() == 3 else logits
    token_loss = F.cross_entropy(picked.float(), targets[masked], reduction="none") / p_mask[rows]
    if response_lengths is None:
        return token_loss.sum() / (total_tokens or masked.numel())
    return (token_loss / response_lengths[rows].clamp(min=1)).sum() / masked.shape[0]


def prediction_source(positions: torch.LongTensor, length: int, *, shifted: bool,
                      opens_block: torch.BoolTensor | None = None) -> torch.LongTensor:
    """Where the prediction of each token position is read: an index into the hidden states
    of the sequence the model ran on ([L], or the doubled [x_t ; x_0] of length 2L for block
    diffusion, where ``opens_block`` says which positions start a block). See the module
    docstring for the rule."""
    if not shifted:
        return positions
    source = positions - 1
    if opens_block is not None:
        source = torch.where(opens_block & (positions > 0), source + length, source)  # the clean copy
    return source


def training_blocks(batch: TokenBatch, block_size: int) -> torch.LongTensor:
    """[B, L] block index per position: the prompt (everything before the response) is block 0."""
    has_response = batch.response_mask.any(dim=1)
    first_response = batch.response_mask.long().argmax(dim=1)
    prompt_lengths = torch.where(has_response, first_response, 0)
    return answer_blocks(prompt_lengths, batch.input_ids.shape[1], block_size)


def maskable_positions(batch: TokenBatch, *, sft: bool, shifted: bool) -> torch.BoolTensor:
    """The tokens the forward process may mask: the response (SFT) or every real token (pre-training),
    never padding, and with shifted prediction never position 0 (nothing left of it predicts it)."""
    maskable = (batch.response_mask if sft else batch.valid).clone()
    if shifted:
        maskable[:, 0] = False
    return maskable


def diffusion_inputs(noisy_ids: torch.LongTensor, batch: TokenBatch, *, attention: str, block_size: int):
    """(input_ids, position_ids, visibility [B, 1, Q, K]) of one training forward."""
    length = noisy_ids.shape[1]
    if attention == BIDIRECTIONAL:
        visible = batch.valid[:, None, None, :].expand(-1, 1, length, -1)
        return noisy_ids, batch.position_ids, visible
    ids = torch.cat([noisy_ids, batch.input_ids], dim=1)
    positions = torch.cat([batch.position_ids, batch.position_ids], dim=1)
    structure = block_diffusion_training_mask(training_blocks(batch, block_size))
    real_keys = torch.cat([batch.valid, batch.valid], dim=1)
    return ids, positions, structure[:, None] & real_keys[:, None, None, :]


def model_loss(model, batch: TokenBatch, mask_token_id: int, config: DiffusionTrainConfig, *,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The masked diffusion loss of an HF causal LM run with the diffusion attention.

    Only the masked positions go through the LM head (it is the widest layer).
    """
    maskable = maskable_positions(batch, sft=config.sft, shifted=config.shifted)
    noised = add_mask_noise(batch.input_ids, maskable, mask_token_id, eps=config.eps, generator=generator)
    ids, positions, visible = diffusion_inputs(noised.noisy_ids, batch, attention=config.attention,
                                               block_size=config.block_size)
    dtype = next(model.parameters()).dtype
    hidden = model.base_model(input_ids=ids, attention_mask=additive_mask(visible, dtype),
                              position_ids=positions).last_hidden_state
    rows, cols = noised.masked.nonzero(as_tuple=True)
    opens_block = None
    if config.attention == BLOCK_CAUSAL:
        blocks = training_blocks(batch, config.block_size)
        opens_block = blocks[rows, cols] != blocks[rows, (cols - 1).clamp(min=0)]
    source = prediction_source(cols, batch.input_ids.shape[1], shifted=config.shifted, opens_block=opens_block)
    logits = model.get_output_embeddings()(hidden[rows, source])
    if config.sft:
        return masked_diffusion_loss(logits, batch.input_ids, noised.masked, noised.p_mask,
                                     response_lengths=batch.response_mask.sum(dim=1).float())
    return masked_diffusion_loss(logits, batch.input_ids, noised.masked, noised.p_mask,
                                 total_tokens=int(batch.valid.sum()))


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------

def collate(samples, pad_id: int, device=None) -> TokenBatch:
    """Right-pad TrainingSamples; padding is hidden from attention and never masked."""
    ids, response, lengths = pad_batch(samples, pad_id)
    width = ids.shape[1]
    valid = torch.arange(width)[None, :] < lengths[:, None]
    positions = torch.arange(width).expand(len(samples), -1).contiguous()
    return TokenBatch(*(t.to(device) for t in (ids, valid, response, positions)))


def load_training_samples(files, tokenizer, *, max_length: int = 256) -> list[TrainingSample]:
    """Prompt/response pairs from response caches (``prompt_ids``/``response_ids`` rows) or from
    prompt files whose rows carry the response (gsm8k ``answer``, alpaca ``output``, ``response``,
    a final assistant message ...). Every file must give at least one pair."""
    if not files:
        raise BlockspecError("no training files given: pass prompt files with responses, or response caches")
    samples = []
    for path in map(Path, files):
        found = load_samples(path, max_length=max_length) if _is_response_cache(path) \
            else _samples_from_prompt_file(path, tokenizer, max_length)
        if not found:
            raise BlockspecError(
                f"{path} gives no prompt/response pair: its rows need a response (a `response`, `output`, "
                f"`completion` or `answer` field, or a final assistant message) that fits in {max_length} tokens")
        samples.extend(found)
    return samples


def _samples_from_prompt_file(path: Path, tokenizer, max_length: int) -> list[TrainingSample]:
    """The rows' prompts as the chat template renders them, each followed by its response and
    the token that ends an assistant turn (as ``responses_from_data`` encodes them)."""
    records, _ = load_prompts([path], shuffle=False)
    end_id = response_end_id(tokenizer)
    samples = []
    for record in records:
        if not (record.response or "").strip():
            continue
        prompt = encode_prompt(tokenizer, record.messages)
        sample = make_sample(prompt, given_response_ids(tokenizer, record.response, end_id), record.id,
                             max_length=max_length)
        if sample is not None:
            samples.append(sample)
    return samples


def _is_response_cache(path: Path) -> bool:
    if not path.is_file():
        raise BlockspecError(f"training file not found: {path}")
    if not path.name.endswith(".jsonl"):
        return False
    with open(path, encoding="utf-8") as handle:
        first = handle.readline()
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "prompt_ids" in row


# ---------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------

#: Settings that may change when a run resumes: they do not touch what is computed.
BOOKKEEPING = ("out", "save_every", "keep_checkpoints", "progress")


@dataclass
class DiffusionTrainConfig:
    out: str
    steps: int = 200
    batch_size: int = 4
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    eps: float = DEFAULT_EPS
    max_length: int = 256
    #: SFT: only response tokens are masked (the prompt stays clean, as at inference).
    sft: bool = True
    #: Dream-style: the prediction for position i is read at i-1.
    shifted: bool = True
    attention: str = BIDIRECTIONAL
    #: block_causal only: positions per block.
    block_size: int = 32
    mask_token_id: int | None = None
    seed: int = 0
    save_every: int = 50
    #: checkpoints kept on disk (the newest ones); 0 keeps all.
    keep_checkpoints: int = KEEP_CHECKPOINTS
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch_size", "block_size"):
            if getattr(self, name) < 1:
                raise BlockspecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 2:
            raise BlockspecError(f"max_length must be >= 2 tokens, got {self.max_length}")
        check_positive(lr=self.lr, grad_clip=self.grad_clip)
        check_at_least(0, weight_decay=self.weight_decay, warmup_ratio=self.warmup_ratio)
        check_seed(self.seed)
        if not 0 < self.eps < 1:
            raise BlockspecError(f"eps must lie in (0, 1), got {self.eps}")
        if self.attention not in ATTENTION_MODES:
            raise BlockspecError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {self.attention!r}")
        if self.save_every < 0 or self.keep_checkpoints < 0:
            raise BlockspecError("save_every and keep_checkpoints must be >= 0")


class DiffusionTrainer(TrainingLoop):
    """Adapt ``model`` (an HF causal LM, trained in place) into a masked diffusion LM."""

    progress_label = "dllm training"

    def __init__(self, config: DiffusionTrainConfig, model, tokenizer, samples, *, resume: bool = False):
        if not samples:
            raise BlockspecError("no training samples")
        self.tokenizer, self.samples = tokenizer, samples
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        model.requires_grad_(True).train()
        super().__init__(out=config.out, model=model, config=config, state=TrainState(), total_steps=config.steps,
                         lr=config.lr, weight_decay=config.weight_decay, warmup_ratio=config.warmup_ratio,
                         grad_clip=config.grad_clip, save_every=config.save_every,
                         keep_checkpoints=config.keep_checkpoints, progress=config.progress)
        self.mask_token_id = self._mask_token_id()
        self.order = SampleOrder(len(samples), config.seed)
        if resume:
            self._resume_latest()
        elif saved_checkpoints(self.out):
            raise BlockspecError(f"{self.out} holds the checkpoints of a run: pass --resume to continue it, "
                                 "or choose another --out")

    def _mask_token_id(self) -> int:
        vocab = self.model.get_input_embeddings().weight.shape[0]
        mask_id = self.config.mask_token_id
        if mask_id is None:  # a model adapted before keeps its mask token
            mask_id = diffusion_settings(self.model.config).get("mask_token_id")
        if mask_id is None:
            mask_id = pick_mask_token(self.tokenizer, vocab)
        if not 0 <= mask_id < vocab:
            raise BlockspecError(f"mask token id {mask_id} lies outside the vocabulary (0..{vocab - 1})")
        return int(mask_id)

    # --- one step -------------------------------------------------------------------

    def _train_step(self, step: int) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        batch = collate([self.samples[i] for i in self.batch_indices(step)], self.pad_id, self.model.device)
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        loss = model_loss(self.model, batch, self.mask_token_id, self.config, generator=generator)
        loss.backward()
        self._update(loss.item())
        return StepResult(self.state.losses[-1])

    def batch_indices(self, step: int) -> list[int]:
        """The samples of ``step``: the next ``batch_size`` of the run's order."""
        size = self.config.batch_size
        return self.order.take(step * size, size)

    # --- the saved model ------------------------------------------------------------

    def diffusion_settings(self) -> dict:
        """The ``dllm`` entry of the saved config: what a sampler needs to run the model."""
        block = self.config.attention == BLOCK_CAUSAL
        return {"mask_token_id": self.mask_token_id, "shifted": self.config.shifted,
                "attention": self.config.attention, "block_size": self.config.block_size if block else None}

    def _write_model(self, directory: Path) -> None:
        """A ``save_pretrained`` directory whose config carries the diffusion settings."""
        self.model.config.dllm = self.diffusion_settings()
        self.model.config.mask_token_id = self.mask_token_id
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def _saved_weights(self, directory: Path) -> dict:
        dtype = next(self.model.parameters()).dtype
        return load_pretrained_strict(type(self.model), directory, dtype=dtype).state_dict()

    def _check_resumable(self, saved_config: dict, directory: Path) -> None:
        now = asdict(self.config)
        changed = [f"{name} {saved_config.get(name)!r} -> {value!r}" for name, value in now.items()
                   if name not in BOOKKEEPING and saved_config.get(name) != value]
        if changed:
            raise BlockspecError(f"{directory} was trained with other settings ({'; '.join(changed)}): "
                                 "resume with the same ones, or start a new run in another --out")


# ---------------------------------------------------------------------------
# From a model name to a trained diffusion LM
# ---------------------------------------------------------------------------

def adapt(init: str, files, config: DiffusionTrainConfig, *, resume: bool = False,
          device: str | None = None) -> tuple[Path, TrainState]:
    """Adapt the causal LM at ``init`` into a masked diffusion LM on ``files``.

    Returns the directory of the trained model and the training state (losses, time).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from blockspec.models.target import resolve_path

    make_output_dir(config.out)
    path = resolve_path(str(init))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise BlockspecError(f"could not load the tokenizer of the model to adapt from {path}: {error}") from error
    samples = load_training_samples(files, tokenizer, max_length=config.max_length)  # bad data fails fast
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError, SafetensorError) as error:
        raise BlockspecError(f"could not load the model to adapt from {path}: {error}") from error
    if device:
        model.to(device)
    trainer = DiffusionTrainer(config, model, tokenizer, samples, resume=resume)
    print(f"{len(samples)} training sequences, {sum(s.num_response_tokens for s in samples)} response tokens, "
          f"mask token {trainer.mask_token_id}", file=sys.stderr, flush=True)
    state = trainer.run()
    return trainer.out / "model", state


def mean_losses(losses: list[float], window: int = 10) -> tuple[float, float, int]:
    """The mean loss of the first and of the last n steps, and n: ``window``, or fewer when
    the run is short (at most half of it, so the two means do not overlap)."""
    if not losses:
        return math.nan, math.nan, 0
    n = max(1, min(window, len(losses) // 2))
    return sum(losses[:n]) / n, sum(losses[-n:]) / n, n
