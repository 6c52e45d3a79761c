"""A DFlash drafter over a reduced draft vocabulary (K of the target's V rows): lossless, saved in the
layout vLLM reads (draft_vocab_size, lm_head.weight, d2t), loadable by the public reference."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.errors import CheckpointError, IncompatibleDraftError
from blockspec.models.dflash.checkpoint import load_dflash_model, save_dflash_model
from blockspec.models.draft_vocab import most_frequent
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    SAMPLES,
    VOCAB,
    chi_square_pvalue,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    prompts,
    sampled_joint,
    small_target,
)

VOCAB_IDS = list(range(0, 320, 3))  # every third token: the target often wants one outside


@pytest.fixture(scope="module")
def world():
    target = make_causal_lm("qwen3", vocab_size=320).double()
    references = [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=12)]
    return target, references


def compressed_drafter(target, ids=VOCAB_IDS, **options):
    return DFlashDrafter(make_dflash(target, block_size=8), target, draft_vocabulary=torch.tensor(ids), **options)


def decode_all(target, references, drafter, **config):
    outputs = []
    for ids, _ in references:
        stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, **config))
        list(stream)
        outputs.append(stream.token_ids)
    return outputs


@pytest.mark.parametrize("config", [{"block_size": 8}, {"block_size": 3}, {"tree_budget": 12},
                                    {"block_size": 8, "denoise_steps": 2}])
def test_compressed_greedy_equals_plain_greedy(world, config):
    target, references = world
    options = {"denoise_steps": config.pop("denoise_steps")} if "denoise_steps" in config else {}
    drafter = compressed_drafter(target, **options)
    assert drafter.lm_head.weight.shape == (len(VOCAB_IDS), 64)
    wanted_outside = sum(token not in VOCAB_IDS for _, expected in references for token in expected)
    assert wanted_outside > 0  # the target wants tokens the draft can never propose
    assert decode_all(target, references, drafter, **config) == [expected for _, expected in references]


def test_drafts_come_from_the_reduced_vocabulary_only(world):
    target, references = world
    drafter = compressed_drafter(target, sequence_tokens=False)
    state = drafter.start(references[0][0], torch.randn(1, references[0][0].shape[1], 128).double())
    logits = drafter.draft_logits(state, 5, 7)
    assert logits.shape == (7, 320)
    outside = torch.ones(320, dtype=torch.bool)
    outside[VOCAB_IDS] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ~outside]).all()
    proposal = drafter.propose(drafter.start(references[0][0], torch.randn(1, references[0][0].shape[1], 128)
                                             .double()), 5, 7, SamplingConfig(temperature=1.0), torch.Generator())
    assert set(proposal.tokens.tolist()) <= set(VOCAB_IDS)
    assert torch.all(proposal.probs[:, outside] == 0)


def test_the_compressed_head_scores_what_the_full_head_scores_on_its_rows(world):  # and the prompt's own
    target, references = world
    draft = make_dflash(target, block_size=8)
    full = DFlashDrafter(draft, target)
    reduced = compressed_drafter(target)
    reduced.model.load_state_dict(full.model.state_dict(), strict=False)
    features = torch.randn(1, 6, 128, generator=torch.Generator().manual_seed(0)).double()
    ids = torch.arange(6).unsqueeze(0)  # 1, 2, 4 and 5 are outside the vocabulary
    full_logits = full.draft_logits(full.start(ids, features), 9, 7)
    reduced_logits = reduced.draft_logits(reduced.start(ids, features), 9, 7)
    rows = VOCAB_IDS + [1, 2, 4, 5]
    assert torch.allclose(full_logits[:, rows], reduced_logits[:, rows])


def test_the_sequences_own_tokens_outside_the_vocabulary_are_drafted_too(world):
    target, references = world
    drafter = compressed_drafter(target)
    prompt = torch.tensor([[3, 7, 7, 10, 301]])  # 3 is in the vocabulary, 7, 10 and 301 are not
    features = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(1)).double()
    state = drafter.start(prompt, features)
    assert state.sequence_rows.ids.tolist() == [7, 10, 301]
    drafter.commit(state, torch.tensor([[11, 7, 12, 320 - 1]]), torch.randn(1, 4, 128).double())
    assert state.sequence_rows.ids.tolist() == [7, 10, 301, 11, 319]  # 12 is in the vocabulary, 7 known
    logits = drafter.draft_logits(state, 5, 7)
    drafted = torch.zeros(320, dtype=torch.bool)
    drafted[VOCAB_IDS + [7, 10, 301, 11, 319]] = True
    assert torch.isinf(logits[:, ~drafted]).all() and torch.isfinite(logits[:, drafted]).all()
    proposal = drafter.propose(state, 5, 7, SamplingConfig(temperature=1.0), torch.Generator())
    assert torch.all(proposal.probs[:, ~drafted] == 0)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(7, dtype=proposal.probs.dtype))


def test_the_sequence_rows_stop_at_their_cap(world):
    target, _ = world
    drafter = compressed_drafter(target, max_sequence_rows=3)
    state = drafter.start(torch.tensor([[1, 2, 4, 5, 7]]), torch.randn(1, 5, 128).double())
    drafter.commit(state, torch.tensor([[8]]), torch.randn(1, 1, 128).double())
    assert state.sequence_rows.ids.numel() == 3 and state.sequence_rows.weight.shape == (3, 64)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_tokens", [False, True])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5)])
def test_compressed_sampling_follows_the_target_distribution(sampling, sequence_tokens):
    target = small_target()
    rows = [0, 1, 3, 4, 6]  # tokens 2 and 5 (and the mask, 7) are outside the draft vocabulary; the prompt has 2
    drafter = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5),
                            target, draft_vocabulary=torch.tensor(rows), sequence_tokens=sequence_tokens)
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    assert sum(v for k, v in probs.items() if set(k) & {2, 5}) > 0.2  # outside tokens matter to the target
    assert sum(v for k, v in probs.items() if 5 in k) > 0.1  # 5 stays outside even with the prompt's 2 in
    counts = sampled_joint(target, drafter, sampling, SAMPLES)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


def test_saved_in_the_layout_vllm_reads_and_loaded_back(world, tmp_path):
    target, references = world
    drafter = compressed_drafter(target)
    save_dflash_model(drafter.model.float(), tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["draft_vocab_size"] == len(VOCAB_IDS) and config["vocab_size"] == 320
    weights = load_file(tmp_path / "draft" / "model.safetensors")
    assert weights["lm_head.weight"].shape == (len(VOCAB_IDS), 64)
    d2t = weights["d2t"]
    assert (torch.arange(len(VOCAB_IDS)) + d2t).tolist() == VOCAB_IDS  # target id = draft id + d2t
    assert "t2d" not in weights
    loaded = DFlashDrafter(load_dflash_model(tmp_path / "draft").double(), target)
    assert loaded.draft_to_target.tolist() == VOCAB_IDS
    assert decode_all(target, references[:4], loaded, block_size=8) == [e for _, e in references[:4]]


def test_a_draft_without_the_extra_tensors_uses_the_full_head(world, tmp_path):
    target, _ = world
    save_dflash_model(make_dflash(target).float(), tmp_path / "draft")
    drafter = DFlashDrafter(load_dflash_model(tmp_path / "draft").double(), target)
    assert drafter.draft_to_target is None and drafter.lm_head is target.get_output_embeddings()


def test_a_shipped_t2d_is_accepted(world, tmp_path):
    target, _ = world
    save_dflash_model(compressed_drafter(target).model.float(), tmp_path / "draft")
    path = tmp_path / "draft" / "model.safetensors"
    weights = load_file(path)
    t2d = torch.zeros(320, dtype=torch.bool)
    t2d[VOCAB_IDS] = True
    save_file({**weights, "t2d": t2d}, path)
    assert load_dflash_model(tmp_path / "draft").draft_to_target.tolist() == VOCAB_IDS


@pytest.mark.parametrize("ids,message", [([5, 320], "outside the target's vocabulary"),
                                         ([-1, 4], "outside the target's vocabulary"),
                                         ([4, 4, 5], "twice")])
def test_a_vocabulary_naming_ids_outside_the_target_is_refused(world, ids, message):
    target, _ = world
    with pytest.raises(IncompatibleDraftError, match=message):
        compressed_drafter(target, ids)


def test_a_checkpoint_whose_d2t_leaves_the_vocabulary_is_refused(world, tmp_path):
    target, _ = world
    save_dflash_model(compressed_drafter(target).model.float(), tmp_path / "draft")
    path = tmp_path / "draft" / "model.safetensors"
    weights = load_file(path)
    weights["d2t"][-1] += 100  # the last draft id now maps past token 319
    save_file(weights, path)
    with pytest.raises(CheckpointError, match="outside the target's vocabulary"):
        load_dflash_model(tmp_path / "draft")


def test_a_compressed_checkpoint_without_its_head_is_refused(world, tmp_path):
    target, _ = world
    save_dflash_model(compressed_drafter(target).model.float(), tmp_path / "draft")
    path = tmp_path / "draft" / "model.safetensors"
    save_file({k: v for k, v in load_file(path).items() if k != "lm_head.weight"}, path)
    with pytest.raises(CheckpointError, match="missing"):
        load_dflash_model(tmp_path / "draft")


def test_a_second_vocabulary_on_a_compressed_draft_is_refused(world):
    target, _ = world
    with pytest.raises(IncompatibleDraftError, match="already drafts"):
        DFlashDrafter(compressed_drafter(target).model, target, draft_vocabulary=torch.arange(10))


def test_most_frequent_keeps_stop_ids_and_fills_from_the_fallback():
    from collections import Counter

    ids = most_frequent(Counter({7: 9, 8: 5, 9: 1}), 4, always=[2], fallback=Counter({11: 3, 7: 2}))
    assert ids.tolist() == [2, 7, 8, 9]
    assert most_frequent(Counter({7: 9}), 4, always=[2], fallback=Counter({11: 3})).tolist() == [0, 2, 7, 11]


def test_the_public_reference_loads_a_compressed_draft_and_keeps_greedy_output(world, tmp_path):
    """The reference (pip package ``dflash``) ignores the extra tensors and drafts through the full head."""
    reference = pytest.importorskip("dflash.model")
    target, references = world
    drafter = compressed_drafter(target)
    save_dflash_model(drafter.model.float(), tmp_path / "draft")
    draft = reference.DFlashDraftModel.from_pretrained(str(tmp_path / "draft")).double().eval()
    for ids, expected in references[:3]:
        out = reference.dflash_generate(draft, target, ids, MAX_NEW, None)
        assert out[0, ids.shape[1]:].tolist() == expected


def test_generate_drafts_over_a_vocabulary_counted_from_data(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    from blockspec.cli import main

    cache = tmp_path / "responses.jsonl"
    cache.write_text("".join(json.dumps({"id": f"r:{i}", "prompt_ids": [5, 6], "response_ids": [7 + i % 30] * 3,
                                         "finished": True}) + "\n" for i in range(60)))
    common = ["generate", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--max-new-tokens", "16",
              "--json", "Write a function"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*common, "--draft-vocab-size", "40", "--draft-vocab-data", str(cache)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == plain
    assert "drafting over 40 of the target's" in captured.err


@pytest.mark.parametrize("extra,message", [
    (["--draft-vocab-size", "40"], "together"),
    (["--draft-vocab-size", "40", "--draft-vocab-data", "missing.jsonl"], "does not exist"),
    (["--draft-vocab-size", "40", "--draft-vocab-data", "x.jsonl", "--method", "ngram"], "not ngram"),
])
def test_bad_draft_vocabulary_options_get_clear_errors(tiny_target_dir, tiny_draft_dir, tmp_path, capsys, extra,
                                                       message, monkeypatch):
    from blockspec.cli import main

    monkeypatch.chdir(tmp_path)
    draft = [] if "ngram" in extra else ["--draft", str(tiny_draft_dir)]
    assert main(["generate", "hi", "--target", str(tiny_target_dir), *draft, "--max-new-tokens", "4", *extra]) != 0
    assert message in capsys.readouterr().err


def test_bench_compares_a_reduced_vocabulary_side_by_side(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    from blockspec.cli import main

    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"id": "a/0", "dataset": "a", "turns": ["the cat sat on the mat"]}) + "\n")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "a dog ran in the park", "response": "the dog ran home"}) + "\n")
    code = main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir),
                 "--methods", "ar,dflash,dflash/v64,dflash@4/v64", "--datasets", str(prompts_file),
                 "--draft-vocab-data", str(data), "--max-new-tokens", "8", "--warmup-tokens", "0",
                 "--no-chat-template", "--no-progress", "--out", str(tmp_path / "out")])
    assert code == 0  # a greedy run: every method's tokens equal ar's
    table = capsys.readouterr().out
    for method in ("dflash", "dflash/v64", "dflash@4/v64"):
        assert f"| a | {method} |" in table


def test_a_reduced_vocabulary_method_needs_its_data(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    from blockspec.cli import main

    code = main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--methods",
                 "ar,dflash/v64", "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "out")])
    assert code != 0 and "--draft-vocab-data" in capsys.readouterr().err
