"""Prompt lookup and the classic draft model: lossless under the one verifier, clear errors."""

import json

import pytest
import torch

from blockspec.cli import main
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.draft_lm import DraftModelDrafter, check_compatible
from blockspec.drafters.ngram import PromptLookupDrafter
from blockspec.drafters.registry import build_drafter, detect_method
from blockspec.errors import BlockspecError, IncompatibleDraftError
from blockspec.models.target import load_target
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    PROMPT,
    SAMPLES,
    TWO_FAMILIES,
    VOCAB,
    chi_square_pvalue,
    decode,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_tokenizer,
    perturbed_copy,
    prompts,
    repetitive_prompts,
    sampled_joint,
    save_tiny_target,
    small_target,
)

NUM_PROMPTS = 20


def run(target, ids, drafter, **config):
    return decode(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, **config))


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    # float64 so that block verification and HF's token-by-token decode cannot disagree by rounding.
    target = make_causal_lm(request.param, vocab_size=320).double()
    half = NUM_PROMPTS // 2
    cases = prompts(320, count=half, seed=1) + repetitive_prompts(320, NUM_PROMPTS - half, seed=2)
    references = [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in cases]
    other_arch = "qwen3" if request.param == "llama" else "llama"
    drafts = {
        "other": make_causal_lm(other_arch, vocab_size=320, seed=9, num_hidden_layers=1).double(),
        "perturbed": perturbed_copy(target),
        "self": target,
    }
    return target, references, drafts


def make_drafter(kind, target, drafts, block_size):
    if kind == "ngram":
        return PromptLookupDrafter(block_size=block_size)
    return DraftModelDrafter(drafts[kind], target, block_size=block_size)


# Draft-model runs cost one draft forward per draft token: the weakest draft (a different
# random LM, tau ~ 1) runs on fewer prompts and block sizes than the others.
CASES = [(kind, block_size, NUM_PROMPTS) for kind in ("ngram", "self") for block_size in (2, 4, 8)]
CASES += [("perturbed", block_size, 8) for block_size in (2, 4, 8)] + [("other", 4, 6)]


@pytest.mark.parametrize("kind,block_size,num_prompts", CASES)
def test_greedy_equals_hf_generate(world, kind, block_size, num_prompts):
    target, references, drafts = world
    drafter = make_drafter(kind, target, drafts, block_size)
    accepted = partial = 0
    for ids, expected in references[:num_prompts // 2] + references[-(num_prompts // 2):]:
        stream = run(target, ids, drafter)
        assert stream.token_ids == expected
        stats = stream.stats
        assert all(1 <= n <= block_size for n in stats.acceptance_lengths)
        accepted += sum(stats.accepted)
        partial += sum(0 < a < d for a, d in zip(stats.accepted, stats.drafted))
        if kind == "self":
            assert all(n == block_size for n in stats.acceptance_lengths[:-1]), stats.acceptance_lengths
        if kind != "ngram":  # the draft's cache holds a prefix of the committed sequence, nothing else
            state = stream.sequence.draft_state
            assert state.cached_tokens == state.tokens[:len(state.cached_tokens)]
    if kind != "other":
        assert accepted > 0
    if kind == "perturbed" and block_size > 2:
        assert partial > 0  # rejections inside a block happened, so the draft cache was cropped


@pytest.mark.parametrize("arch", TWO_FAMILIES)
def test_ngram_drafts_on_repetitive_text(arch):
    # A small vocabulary makes the random target repeat itself, as real models do on code.
    target = make_causal_lm(arch, vocab_size=32).double()
    drafter = PromptLookupDrafter()
    taus = []
    for ids in repetitive_prompts(32, 10, seed=2):
        stream = run(target, ids, drafter)
        assert stream.token_ids == hf_greedy(target, ids, MAX_NEW)
        assert sum(stream.stats.drafted) > 0
        taus.append(stream.stats.tau)
    assert max(taus) > 1.5 and sum(taus) / len(taus) > 1.2, taus


def test_draft_with_a_padded_vocabulary():
    target = make_causal_lm("llama", vocab_size=320).double()
    draft = perturbed_copy(target)
    draft.resize_token_embeddings(336)  # the padded embedding rows of many released models
    drafter = DraftModelDrafter(draft, target)
    for ids in prompts(320, count=5, seed=3):
        assert run(target, ids, drafter).token_ids == hf_greedy(target, ids, MAX_NEW)
    state = drafter.start(prompts(320, count=1, seed=4)[0], None)
    sampled = drafter.propose(state, 5, 3, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (3, 320)


# --- prompt lookup on its own -------------------------------------------------------------

def lookup(history, num_tokens=4, **options):
    drafter = PromptLookupDrafter(**options)
    state = drafter.start(torch.tensor([history[:-1]]), None)
    return drafter.propose(state, history[-1], num_tokens, SamplingConfig(), None).tokens.tolist()


@pytest.mark.parametrize("history,expected", [
    ([1, 2, 3, 4, 1, 2], [3, 4, 1, 2]),
    ([5, 9, 1, 2, 7, 3, 2, 8, 1, 2], [7, 3, 2, 8]),  # the longest suffix wins over a later 1-gram
    ([1, 2, 7, 1, 2, 8, 1, 2], [8, 1, 2, 8]),  # the most recent match wins
    ([4, 4, 4], [4, 4, 4, 4]),  # a repeat continues past the end of the history
    ([1, 2, 3, 4], []),  # nothing to copy
])
def test_prompt_lookup(history, expected):
    assert lookup(history) == expected


def test_prompt_lookup_respects_min_ngram():
    assert lookup([1, 2, 9, 5, 2], min_ngram=2) == []
    assert lookup([1, 2, 9, 5, 2], min_ngram=1) == [9, 5, 2, 9]


def test_prompt_lookup_follows_commits():
    drafter = PromptLookupDrafter()
    state = drafter.start(torch.tensor([[1, 2, 3]]), None)
    assert drafter.propose(state, 4, 3, SamplingConfig(), None).tokens.tolist() == []
    drafter.commit(state, torch.tensor([[4, 1]]), None)  # the last token 4, one accepted draft
    drafter.commit(state, torch.tensor([[2]]), None)  # a step where nothing was proposed
    assert drafter.propose(state, 3, 3, SamplingConfig(), None).tokens.tolist() == [4, 1, 2]
    assert state.tokens == [1, 2, 3, 4, 1, 2, 3]


def test_prompt_lookup_stays_cheap_on_long_contexts():
    drafter = PromptLookupDrafter()
    state = drafter.start(torch.randint(0, 50, (1, 4000), generator=torch.Generator().manual_seed(0)), None)
    for token in range(200):
        proposal = drafter.propose(state, token % 50, 7, SamplingConfig(), None)
        drafter.commit(state, torch.tensor([[token % 50, *proposal.tokens[:2].tolist()]]), None)
    assert len(state.tokens) > 4000


# --- sampling: the output follows the target's distribution -------------------------------

@pytest.fixture(scope="module")
def tiny_vocab_target():
    return small_target()


@pytest.mark.slow
@pytest.mark.parametrize("kind,sampling", [
    ("draft", SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)),
    ("ngram", SamplingConfig(temperature=1.0)),
])
def test_speculative_sampling_matches_target_sampling(tiny_vocab_target, kind, sampling):
    if kind == "draft":
        # another small LM whose vocabulary is padded past the target's
        draft = make_causal_lm("llama", vocab_size=VOCAB + 2, seed=5, hidden_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3)
        drafter = DraftModelDrafter(draft, tiny_vocab_target)
    else:
        drafter = PromptLookupDrafter()
    probs = {k: v for k, v in exact_joint(tiny_vocab_target, sampling).items() if v > 0}
    counts = sampled_joint(tiny_vocab_target, drafter, sampling, SAMPLES)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


def test_sampled_drafts_carry_their_distribution(tiny_vocab_target):
    draft = make_causal_lm("llama", vocab_size=VOCAB, seed=5, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    drafter = DraftModelDrafter(draft, tiny_vocab_target)
    state = drafter.start(PROMPT, None)
    proposal = drafter.propose(state, 4, 3, SamplingConfig(temperature=0.8, top_k=3), torch.Generator().manual_seed(0))
    assert proposal.probs.shape == (3, VOCAB)
    assert torch.allclose(proposal.probs.sum(dim=-1), torch.ones(3))
    assert ((proposal.probs > 0).sum(dim=-1) <= 3).all()
    assert (proposal.probs[torch.arange(3), proposal.tokens] > 0).all()
    drafter.sample_drafts = False
    assert drafter.propose(state, 4, 3, SamplingConfig(temperature=0.8), None).probs is None


# --- compatibility and the registry -------------------------------------------------------

def test_the_same_tokenizer_and_a_padded_superset_are_compatible():
    target = make_tokenizer()
    check_compatible(make_tokenizer(), target)
    larger = make_tokenizer()
    larger.add_tokens(["<extra_0>", "<extra_1>"])
    check_compatible(larger, target)


def test_another_tokenizer_is_refused():
    target = make_tokenizer()
    with pytest.raises(IncompatibleDraftError, match="does not share the target's tokenizer: .* missing in the draft"):
        check_compatible(make_tokenizer(vocab_size=300), target)
    larger = make_tokenizer()
    larger.add_tokens(["<extra_0>"])
    with pytest.raises(IncompatibleDraftError, match="'<extra_0>' is id 320 in the target but missing"):
        check_compatible(target, larger)


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return load_target(str(tiny_target_dir), device="cpu")


@pytest.fixture(scope="module")
def tiny_lm_draft_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny-lm-draft"), arch="qwen3", seed=3)


def test_build_a_draft_model_drafter_from_a_directory(tiny_target, tiny_lm_draft_dir):
    drafter = build_drafter("draft", tiny_target, str(tiny_lm_draft_dir), block_size=3)
    assert isinstance(drafter, DraftModelDrafter) and drafter.default_block_size == 3
    assert drafter.model.dtype == tiny_target.model.dtype and drafter.model.device == tiny_target.device
    assert detect_method(tiny_lm_draft_dir) == "draft"
    ids = tiny_target.encode_prompt("What is 12 times 7?")
    assert run(tiny_target.model, ids, drafter).token_ids == hf_greedy(tiny_target.model, torch.tensor([ids]),
                                                                     MAX_NEW)


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_target, tmp_path):
    make_causal_lm("llama", vocab_size=300).save_pretrained(tmp_path)
    make_tokenizer(vocab_size=300).save_pretrained(tmp_path)
    with pytest.raises(IncompatibleDraftError, match="does not share the target's tokenizer"):
        build_drafter("draft", tiny_target, str(tmp_path))


@pytest.mark.parametrize("method,draft,options,message", [
    ("eagle", None, {}, "unknown drafting method 'eagle'; choose one of dflash, dflash2, dspark, domino, eagle3, mtp, "
                        "draft, ngram"),
    ("ar", None, {}, "'ar' decodes without a drafter"),
    ("dflash+ngram", "some/dir", {}, "it is now called 'dflash\\+lookup'"),
    ("dflash", None, {}, "the dflash method needs a draft: a DFlash checkpoint directory"),
    ("eagle3", None, {}, "the eagle3 method needs a draft: an EAGLE-3 checkpoint directory"),
    ("mtp", "/no/such/dir", {}, "/no/such/dir does not exist"),
    ("draft", None, {}, "the draft method needs a draft: a causal LM directory or a known model name"),
    ("ngram", "some/dir", {}, "takes no draft model"),
    ("ngram", None, {"window": 3}, "the ngram method takes no option window: its options are max_ngram"),
    ("ngram", None, {"max_ngram": 1, "min_ngram": 2}, r"max_ngram \(1\) must be >= min_ngram \(2\)"),
    ("ngram", None, {"min_ngram": 0}, "min_ngram must be >= 1"),
])
def test_build_drafter_errors(tiny_target, method, draft, options, message):
    with pytest.raises(BlockspecError, match=message):
        build_drafter(method, tiny_target, draft, **options)


def test_build_prompt_lookup_with_options(tiny_target):
    drafter = build_drafter("ngram", tiny_target, max_ngram=5, min_ngram=2, block_size=6)
    assert drafter.config.max_ngram == 5 and drafter.default_block_size == 6


# --- the command line ---------------------------------------------------------------------

def generate_json(capsys, *args):
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_generate_with_prompt_lookup(tiny_target_dir, capsys):
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    common = ["--target", str(tiny_target_dir), "--max-new-tokens", "24", "--no-chat-template"]
    ngram = generate_json(capsys, *common, "--method", "ngram", prompt)
    plain = generate_json(capsys, *common, prompt)
    assert ngram["token_ids"] == plain["token_ids"]
    stats = ngram["stats"]
    assert stats["new_tokens"] == len(ngram["token_ids"]) and sum(stats["drafted"]) > 0
    assert stats["target_forwards"] == 1 + len(stats["acceptance_lengths"])


def test_cli_generate_with_a_draft_model(tiny_target_dir, tiny_lm_draft_dir, capsys):
    common = ["--target", str(tiny_target_dir), "--max-new-tokens", "16", "Write a function"]
    detected = generate_json(capsys, "--draft", str(tiny_lm_draft_dir), *common)
    named = generate_json(capsys, "--method", "draft", "--draft", str(tiny_lm_draft_dir), "--block-size", "3", *common)
    plain = generate_json(capsys, *common)
    assert detected["token_ids"] == named["token_ids"] == plain["token_ids"]
    assert max(named["stats"]["drafted"]) == 2


@pytest.mark.parametrize("args,message", [
    (["--method", "ngram", "--draft", "x"], "--method ngram drafts from the prompt and takes no --draft"),
    (["--method", "draft"], "--method draft needs --draft MODEL"),
    (["--method", "mtp"], "--method mtp needs --draft DIR"),
])
def test_cli_method_errors(tiny_target_dir, args, message, capsys):
    assert main(["generate", "--target", str(tiny_target_dir), *args, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and message in err and err.count("\n") == 1


def test_the_default_target_with_draft_methods():
    from blockspec.cli import build_parser
    from blockspec.cli.generate import drafter_choice

    args = build_parser().parse_args(["generate", "--method", "ngram", "hello"])
    assert drafter_choice(args) == ("ngram", None, {})
    args = build_parser().parse_args(["generate", "--method", "draft", "--draft", "qwen2.5-coder-0.5b-instruct", "hi"])
    assert drafter_choice(args) == ("draft", "qwen2.5-coder-0.5b-instruct", {"sample_drafts": True})
    assert detect_method("qwen2.5-coder-0.5b-instruct") == "draft"


# --- a draft LM shipped without the embeddings it shares with the target --------------------

def _save_target(directory, *, tied: bool, hidden_size: int = 64):
    tokenizer = make_tokenizer()
    model = make_causal_lm("llama", vocab_size=len(tokenizer), tie_word_embeddings=tied, hidden_size=hidden_size)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return load_target(str(directory), device="cpu")


def _save_draft(target, directory, *, drop=("model.embed_tokens.weight", "lm_head.weight"), seed=0):
    """A 2-layer draft LM of the target's layers, its weights perturbed, saved without ``drop``."""
    import safetensors.torch as st

    from blockspec.training.methods import shrink_target

    draft = perturbed_copy(shrink_target(target.model, 2), scale=0.01, seed=seed)
    draft.save_pretrained(directory)
    weights = st.load_file(directory / "model.safetensors")
    st.save_file({k: v for k, v in weights.items() if k not in drop}, directory / "model.safetensors",
                 metadata={"format": "pt"})
    return draft


def test_a_draft_lm_shipped_without_embeddings_drafts_with_the_targets(tmp_path):
    import subprocess
    import sys

    from blockspec.drafters.draft_lm import shares_target_embeddings
    from blockspec.drafters.registry import load_drafter

    target = _save_target(tmp_path / "target", tied=True)
    trained = tmp_path / "trained"
    draft = _save_draft(target, trained, drop=())
    shipped = tmp_path / "shipped"
    subprocess.run([sys.executable, "scripts/ship_drafter.py", "--without-embeddings", str(trained), str(shipped)],
                   check=True, capture_output=True)
    assert shares_target_embeddings(shipped) and not shares_target_embeddings(trained)
    assert not (shipped / "tokenizer.json").exists()  # the target's tokenizer is used
    drafter = load_drafter(shipped, target)
    assert isinstance(drafter, DraftModelDrafter)
    torch.testing.assert_close(drafter.model.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    assert drafter.model.get_output_embeddings().weight is drafter.model.get_input_embeddings().weight
    layer = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(drafter.model.state_dict()[layer], draft.state_dict()[layer].bfloat16().float())
    for seed in range(4):
        ids = torch.randint(4, 320, (1, 6), generator=torch.Generator().manual_seed(seed))
        stream = run(target.model, ids[0].tolist(), drafter)
        assert stream.token_ids == hf_greedy(target.model, ids, MAX_NEW)
        assert sum(stream.stats.accepted) > 0


def test_a_draft_lm_without_embeddings_keeps_its_own_untied_head(tmp_path):
    from blockspec.drafters.draft_lm import load_draft_model

    target = _save_target(tmp_path / "target", tied=False)
    draft = _save_draft(target, tmp_path / "draft", drop=("model.embed_tokens.weight",))
    loaded = load_draft_model(tmp_path / "draft", target)
    torch.testing.assert_close(loaded.get_output_embeddings().weight, draft.get_output_embeddings().weight)
    torch.testing.assert_close(loaded.get_input_embeddings().weight, target.model.get_input_embeddings().weight)


def test_a_draft_lm_without_embeddings_for_another_target_is_a_clear_error(tmp_path):
    from blockspec.drafters.draft_lm import load_draft_model

    target = _save_target(tmp_path / "target", tied=True)
    _save_draft(target, tmp_path / "draft")
    other = _save_target(tmp_path / "other", tied=True, hidden_size=32)
    with pytest.raises(IncompatibleDraftError, match=r"saved without embeddings, to use the target's, but its "
                                                     r"\(320, 64\) embedding shape is not the target's \(320, 32\)"):
        load_draft_model(tmp_path / "draft", other)
    _save_draft(target, tmp_path / "torn", drop=("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(BlockspecError, match=r"lacks weights besides its embeddings "
                                             r"\(model.layers.0.mlp.up_proj.weight\): re-save it whole"):
        load_draft_model(tmp_path / "torn", target)
