"""What the tests share: tiny models and tokenizers built in the test itself (no network,
milliseconds), prompt sets, reference decoders, drafters for tests, the exact-distribution
machinery of the sampling tests, and a test server. Overrides come in as arguments; no test
patches this module.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from scipy.stats import chisquare
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from blockspec.decoding.costs import CostModel
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.dllm.model import HFDiffusionModel
from blockspec.drafters.base import PositionwiseDrafter, Proposal
from blockspec.models.dflash.config import make_dflash_config
from blockspec.models.dflash.modules import DFlashDraftModel
from blockspec.models.eagle3 import Eagle3DraftModel, make_eagle3_config
from blockspec.models.mtp import MTPDraftModel, make_mtp_config
from blockspec.models.target import Target, load_target
from blockspec.sampling import SamplingConfig, sampling_probs
from blockspec.training.pipeline import DataConfig, prepare_samples
from blockspec.training.trainer import TrainConfig

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: A chat template that takes tools and earlier calls, answering calls in the Hermes <tool_call> format.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool['function']['name'] }} "
    "{% endfor %}</tools> <tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{% for call in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "What is 12 times 7? Let's think step by step. 12 * 7 = 84. The answer is 84.",
    "Write a function that returns the sum of a list of numbers.",
] * 4


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with chat special tokens and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
        return Qwen3Config(**common)
    if arch in FAMILY_CONFIGS:
        return family_config(arch, common)
    raise ValueError(arch)


def make_causal_lm(arch: str = "llama", vocab_size: int = 320, seed: int = 0, **overrides):
    """A randomly initialised tiny causal LM in eval mode.

    initializer_range is raised so that logits are far from ties: greedy comparisons
    then test the algorithm rather than floating-point noise.
    """
    torch.manual_seed(seed)
    overrides.setdefault("initializer_range", 0.2)
    config = tiny_config(arch, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def save_tiny_target(directory: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A target checkpoint directory (model + tokenizer) as a user would have one."""
    tokenizer = make_tokenizer()
    model = make_causal_lm(arch, vocab_size=len(tokenizer), seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


# --- drafter networks ---------------------------------------------------------------------

def make_dflash(target, num_layers=2, block_size=16, mask_token_id=3, seed=1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = make_dflash_config(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id)
    return DFlashDraftModel(config).to(next(target.parameters()).dtype).eval()


def make_dspark(target, *, kind="vanilla", rank=8, confidence=True, anchor=True, num_layers=2, block_size=6,
                mask_token_id=3, seed=1) -> DFlashDraftModel:
    """A randomly initialised DSpark draft: the DFlash backbone with a Markov head of ``kind``, a confidence head
    and DSpark's block convention (``anchor``: the anchor's slot predicts). Its Markov head is scaled up so that
    the bias really changes what each position drafts."""
    torch.manual_seed(seed)
    config = make_dflash_config(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id)
    config.markov_rank, config.markov_head_type = rank, kind
    config.enable_confidence_head, config.confidence_head_with_markov = confidence, True
    config.sample_from_anchor = anchor
    model = DFlashDraftModel(config)
    with torch.no_grad():
        model.markov_head.markov_w1.weight.normal_(0, 1.0)
        model.markov_head.markov_w2.weight.normal_(0, 1.0)
    return model.to(next(target.parameters()).dtype).eval()


def make_domino(target, *, anchor=False, prefix=0, gru=16, emb=12, num_layers=2, block_size=6, mask_token_id=3,
                seed=1) -> DFlashDraftModel:
    """A randomly initialised Domino draft (SpecForge's layout): the DFlash backbone and the GRU correction head,
    scaled up so that the correction really changes what each position drafts."""
    torch.manual_seed(seed)
    config = make_dflash_config(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id)
    config.dflash_config.update(projector_type="domino", gru_hidden_dim=gru, emb_dim=emb,
                                pure_draft_prefix_len=prefix, shift_label=anchor)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for parameter in model.domino_head.parameters():
            parameter.normal_(0, 0.6)
    return model.to(next(target.parameters()).dtype).eval()


def make_dflash2(target, *, anchor=False, taps=2, group=16, rank=8, top_k=4, num_layers=2, block_size=6,
                 mask_token_id=3, seed=1, **scalars) -> DFlashDraftModel:
    """A randomly initialised DFlash2 draft (z-lab's layout): convolutions around every sublayer, a candidate
    selector, sliding-window layers that see the whole block; ``scalars``: further dflash_config keys
    (input_embedding_scale, output_multiplier, final_logit_softcapping, attention_value_scale)."""
    torch.manual_seed(seed)
    config = make_dflash_config(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id)
    config.dflash_config.update(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank,
                                selector_top_k=top_k, **scalars)
    config.layer_types, config.sliding_window, config.is_causal = ["sliding_attention"] * num_layers, 64, False
    config.sample_from_anchor = anchor
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                parameter.normal_(0, 0.5)
    return model.to(next(target.parameters()).dtype).eval()


RECURSIVE_KINDS = {"eagle3": (Eagle3DraftModel, make_eagle3_config), "mtp": (MTPDraftModel, make_mtp_config)}


def make_recursive(kind, target, *, draft_vocab_size=None, seed=1, ttt_steps=3):
    """A randomly initialised EAGLE-3 or MTP draft; with draft_vocab_size, a random draft vocabulary."""
    model_class, make_config = RECURSIVE_KINDS[kind]
    torch.manual_seed(seed)
    model = model_class(make_config(target.config, draft_vocab_size=draft_vocab_size, ttt_steps=ttt_steps))
    if draft_vocab_size:
        vocab = target.config.vocab_size
        order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
        model.set_draft_vocabulary(order[:draft_vocab_size])
    if kind == "mtp":
        model.attach_target(target)
    return model.to(next(target.parameters()).dtype).eval()


def perturbed_copy(model, scale=0.02, seed=0):
    """A draft that agrees with the target often, but not always: rejections mid-block."""
    generator = torch.Generator().manual_seed(seed)
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in noisy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    return noisy


class NoisyOracle(PositionwiseDrafter):
    """A drafter offering per-position distributions in which the true next token is often,
    but not always, first: second place sends the chain astray and the tree to a sibling.

    ``reference`` is the whole greedy sequence (prompt + answer); its state is the position."""

    name = "noisy-oracle"
    max_draft_tokens = 7
    default_block_size = 8

    def __init__(self, reference, vocab, seed=0):
        self.reference = reference
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, prompt_ids, features):
        return {"position": prompt_ids.shape[1]}

    def commit(self, state, tokens, features):
        state["position"] += tokens.shape[1]

    def draft_logits(self, state, last_token, num_tokens):
        start = state["position"] + 1
        logits = torch.randn(num_tokens, self.vocab, generator=self.generator)
        for k in range(num_tokens):
            if start + k < len(self.reference):
                true = self.reference[start + k]
                rank = int(torch.randint(0, 3, (1,), generator=self.generator))  # 0: first, 1: second, 2: gone
                boost = {0: 8.0, 1: 6.0, 2: -8.0}[rank]
                logits[k, true] = boost
                if rank == 1:
                    logits[k, (true + 1) % self.vocab] = 7.0
        return logits

    def propose(self, state, last_token, num_tokens, sampling, generator):
        return Proposal(self.draft_logits(state, last_token, num_tokens).argmax(-1))


class FixedCosts(CostModel):
    """Synthetic T(w), not to be "refined" by this machine's real timings."""

    def observe(self, width, seconds, batch=1):
        pass


# --- training and diffusion ----------------------------------------------------------------

def small_config(out, **overrides):
    """A drafter training config that runs in seconds on the learned tiny target."""
    values = dict(out=str(out), num_layers=1, block_size=8, batch_size=4, lr=3e-3, anchors_per_sequence=6,
                  max_steps=40, save_every=10, progress=False, eval_max_new_tokens=24)
    values.update(overrides)
    return TrainConfig(**values)


def first_response_cache(learned_target, tmp_path) -> Path:
    """Responses of the learned target to 24 of its prompts, generated into a cache: its path."""
    target, _, prompts = learned_target
    out = tmp_path / "gen"
    prepare_samples(target, DataConfig(files=[str(prompts)], max_new_tokens=8, held_out=4, num_prompts=24), out,
                    max_length=256)
    return out / "data" / "responses.jsonl"


#: The mask token id of the tiny diffusion models.
DLLM_MASK = 3


def tiny_dllm(shifted=False, attention=None, layers=2, seed=0, mask=DLLM_MASK):
    """A random tiny Llama run as a masked-diffusion model."""
    model = HFDiffusionModel(make_causal_lm("llama", 320, seed=seed, num_hidden_layers=layers).eval(), mask,
                             shifted=shifted)
    if attention:
        model.attention = attention
    return model



# --- prompts and reference decoding -------------------------------------------------------

#: The two small families a behaviour's tests run on: qwen3 in the fast tier, llama too in the long one
#: (tests/test_families.py checks every family's lossless decoding in both).
TWO_FAMILIES = [pytest.param("llama", marks=pytest.mark.slow), "qwen3"]

MAX_NEW = 24


def prompts(vocab_size, count=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=generator)
    return [torch.randint(4, vocab_size, (1, int(n)), generator=generator) for n in lengths]


def repetitive_prompts(vocab_size, count, seed=0):
    """Random phrases said several times, with some noise between them."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(count):
        phrase = torch.randint(4, vocab_size, (int(torch.randint(3, 8, (1,), generator=generator)),),
                               generator=generator)
        noise = torch.randint(4, vocab_size, (3,), generator=generator)
        repeats = int(torch.randint(2, 4, (1,), generator=generator))
        result.append(torch.cat([phrase, noise] * repeats + [phrase[:2]]).unsqueeze(0))
    return result


def hf_greedy(model, ids, max_new, eos=None):
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    tokens = out[0, ids.shape[1]:].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    return tokens


def decode(target, ids, drafter, config=None, **options):
    """Run a stream to its end; the stream (its token_ids, stats, sequence) is returned."""
    stream = speculative_generate(target, ids, drafter, config or GenerationConfig(max_new_tokens=MAX_NEW), **options)
    list(stream)
    return stream


# --- the exact-distribution test of sampling ----------------------------------------------

VOCAB = 8
# Fixed seeds make every test deterministic; a correct sampler passes at PASS, and a broken
# one must fall far below it.
PASS = 1e-4
PROMPT = torch.tensor([[1, 2, 3]])
NEW_TOKENS = 3
SAMPLES = 2500


def small_target():
    """The tiny-vocabulary target whose output distribution the tests enumerate exactly."""
    return make_causal_lm("qwen3", vocab_size=VOCAB, seed=11, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.3)


def chi_square_pvalue(counts: dict, probs: dict, total: int) -> float:
    """Pearson chi-square, pooling cells with an expected count under 5."""
    observed, expected, pool_obs, pool_exp = [], [], 0.0, 0.0
    for cell, p in probs.items():
        if p * total < 5:
            pool_obs, pool_exp = pool_obs + counts.get(cell, 0), pool_exp + p * total
        else:
            observed.append(counts.get(cell, 0))
            expected.append(p * total)
    if pool_exp > 0:
        observed.append(pool_obs)
        expected.append(pool_exp)
    assert sum(counts.values()) == total and set(counts) <= set(probs), "a sample outside the support"
    scale = total / sum(expected)  # float32 probabilities do not sum to exactly 1
    return chisquare(observed, [e * scale for e in expected]).pvalue


def exact_joint(target, sampling: SamplingConfig, adjust=None) -> dict:
    """P(t1, t2, t3) under plain sampling from the target, by enumeration. ``adjust(logits [V], prompt, output)``:
    what changes the logits of each position given the tokens before it (None: nothing)."""
    joint = {}
    prompt = PROMPT[0].tolist()
    with torch.no_grad():
        for prefix in itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1):
            ids = torch.cat([PROMPT, torch.tensor([prefix])], dim=1)
            logits = target(ids).logits[0, -NEW_TOKENS:]
            if adjust is not None:
                logits = torch.stack([adjust(logits[i], prompt, list(prefix[:i])) for i in range(NEW_TOKENS)])
            probs = sampling_probs(logits, sampling)
            head = float(probs[0, prefix[0]] * probs[1, prefix[1]])
            for last in range(VOCAB):
                joint[(*prefix, last)] = head * float(probs[2, last])
    return joint


def sampled_joint(target, drafter, sampling: SamplingConfig, samples: int, *, block_size=3,
                  tree_budget=None, tree_top_k=8, width_policies=None, fast=None, **options) -> dict:
    """Counts of the NEW_TOKENS-token outputs of ``samples`` speculative decodes, each seeded (through torch's
    global generator with an adaptive width, which a request's own seed would pin to its widest). ``options``:
    further ``GenerationConfig`` fields."""
    counts = {}
    for seed in range(samples):
        if block_size == "auto":
            torch.manual_seed(seed)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, block_size=block_size, temperature=sampling.temperature,
                                  top_p=sampling.top_p, top_k=sampling.top_k,
                                  seed=None if block_size == "auto" else seed, tree_budget=tree_budget,
                                  tree_top_k=tree_top_k, min_p=sampling.min_p, **options)
        stream = decode(target, PROMPT, drafter, config, width_policies=width_policies, fast=fast)
        key = tuple(stream.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


# --- a server on a free loopback port -----------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(app):
    """Serve ``app`` with uvicorn in a background thread on a free loopback port; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def load_served_target(directory) -> Target:
    # float64: a batched forward and a one-row forward then cannot disagree by rounding.
    target = load_target(str(directory), device="cpu")
    target.model.double()
    return target


# --- the target families with public DFlash drafts ------------------------------------------

#: The sliding window of the tiny sliding-window targets: prompts and answers cross it.
TINY_WINDOW = 8


def _qwen3_5(**common):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    # Gated DeltaNet (linear attention) in layers 0-2, full attention in layer 3
    return Qwen3_5TextConfig(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, **common)


def _qwen3_next(**common):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=64, experts_implementation="eager", **common)


def _gpt_oss(**common):
    from transformers import GptOssConfig

    # sliding-window and full layers, attention sinks, MoE; yarn as the family ships it
    rope = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16, "rope_theta": 150000.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    return GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=TINY_WINDOW,
                        layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=rope,
                        experts_implementation="eager", **common)


def _gemma4(**common):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    # sliding-window and full layers (wider heads), per-layer input embeddings
    return Gemma4TextConfig(head_dim=16, global_head_dim=32, sliding_window=TINY_WINDOW,
                            layer_types=["sliding_attention", "full_attention"] * 2, vocab_size_per_layer_input=320,
                            hidden_size_per_layer_input=16, **common)


def _deepseek_v3(**common):
    from transformers import DeepseekV3Config

    # multi-head latent attention (one key/value head per query head), MoE after the first layer
    common["num_key_value_heads"] = common["num_attention_heads"]
    return DeepseekV3Config(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=1, moe_intermediate_size=32, experts_implementation="eager",
                            **common)


def _qwen2(**common):
    from transformers import Qwen2Config

    return Qwen2Config(**common)


def _qwen3_moe(**common):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          experts_implementation="eager", **common)


#: tiny_config's families beyond llama and qwen3 (MoE experts run eagerly: float64 has no grouped matmul).
FAMILY_CONFIGS = {"qwen2": _qwen2, "qwen3_moe": _qwen3_moe, "qwen3_5": _qwen3_5, "qwen3_next": _qwen3_next,
                  "gpt_oss": _gpt_oss, "gemma4": _gemma4, "deepseek_v3": _deepseek_v3}
#: Every family the family matrix decodes.
FAMILIES = ("llama", "qwen2", "qwen3", *[f for f in FAMILY_CONFIGS if f != "qwen2"])


def family_config(arch: str, common: dict):
    return FAMILY_CONFIGS[arch](**common)
