"""EAGLE-3, MTP, the draft LM and DFlash over a reduced draft vocabulary, trained by the one trainer: they
learn, save, load and stay lossless."""

import copy

import pytest
import torch

from blockspec.decoding.generate import GenerationConfig, speculative_generate
from blockspec.drafters.registry import build_drafter, detect_method
from blockspec.models.target import Target
from blockspec.training.checkpoints import latest_checkpoint
from blockspec.training.methods import frequent_tokens
from blockspec.training.trainer import Trainer
from helpers import TWO_FAMILIES, small_config

METHODS = ["eagle3", "mtp", "draft", "dflash-reduced"]
OPTIONS = {"eagle3": dict(draft_vocab_size=200, ttt_steps=3), "mtp": dict(draft_vocab_size=200, ttt_steps=3),
           "draft": dict(num_layers=1),
           "dflash-reduced": dict(method="dflash", draft_vocab_size=40, anchors_per_sequence=12)}
#: steps of the trained fixture: a block drafter needs more than the one-token-ahead heads
STEPS = {"dflash-reduced": 100}


def method_config(out, method, **overrides):
    return small_config(out, **{"method": method, **OPTIONS[method], **overrides})


def method_name(method):
    return method.split("-")[0]


@pytest.fixture(scope="module")
def trained(learned_target, training_data, tmp_path_factory):
    """Each method trained for a few seconds: (untrained tau, trained tau, losses, output directory)."""
    target, _, _ = learned_target
    samples, eval_prompts = training_data
    results = {}
    for method in METHODS:
        out = tmp_path_factory.mktemp(method)
        trainer = Trainer(method_config(out, method, max_steps=STEPS.get(method, 60), lr=3e-3), target, samples,
                          eval_prompts)
        untrained = trainer.evaluate()["tau"]
        state = trainer.run()
        results[method] = (untrained, trainer.evaluate()["tau"], state.losses, out)
    return results


@pytest.mark.parametrize("method", METHODS)
def test_training_lowers_the_loss_and_raises_tau(trained, method):
    untrained, tau, losses, _ = trained[method]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert tau > untrained + 0.5, (untrained, tau)


@pytest.mark.parametrize("method", METHODS)
def test_the_saved_draft_loads_by_its_method_and_keeps_tau(trained, learned_target, training_data, method):
    target, _, _ = learned_target
    _, tau, _, out = trained[method]
    assert detect_method(out / "draft") == method_name(method)
    drafter = build_drafter(method_name(method), target, str(out / "draft"))
    _, eval_prompts = training_data
    lengths = []
    for ids in eval_prompts:
        stream = speculative_generate(target.model, ids, drafter, GenerationConfig(max_new_tokens=24))
        list(stream)
        lengths += stream.stats.acceptance_lengths
    assert sum(lengths) / len(lengths) == pytest.approx(tau, abs=0.3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_trained_drafters_are_lossless(trained, learned_target, training_data, method, block_size):
    target, _, _ = learned_target
    samples, eval_prompts = training_data
    # float64: block verification and one-token decoding cannot disagree by rounding
    reference = Target(copy.deepcopy(target.model).double(), target.tokenizer, "learned-fp64")
    options = {} if method == "dflash-reduced" else {"block_size": block_size}
    drafter = build_drafter(method_name(method), reference, str(trained[method][3] / "draft"), **options)
    if method == "draft":
        drafter.model.double()
    prompts = list(eval_prompts) + [s.input_ids[~s.loss_mask].unsqueeze(0) for s in samples[:16]]
    accepted = 0
    for ids in prompts:
        plain = speculative_generate(reference.model, ids, None, GenerationConfig(max_new_tokens=24))
        list(plain)
        stream = speculative_generate(reference.model, ids, drafter,
                                      GenerationConfig(max_new_tokens=24, block_size=block_size))
        list(stream)
        assert stream.token_ids == plain.token_ids
        assert all(1 <= n <= block_size for n in stream.stats.acceptance_lengths)
        accepted += sum(stream.stats.accepted)
    assert accepted > 0


@pytest.mark.parametrize("method", ["eagle3", "draft", "dflash-reduced"])
def test_interrupted_and_resumed_run_reproduces_the_losses(learned_target, training_data, tmp_path, method):
    target, _, _ = learned_target
    samples, _ = training_data
    whole = Trainer(method_config(tmp_path / "whole", method, max_steps=8, save_every=4), target, samples).run()
    Trainer(method_config(tmp_path / "cut", method, max_steps=8, save_every=4), target, samples).run(until_step=4)
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000004"
    resumed = Trainer(method_config(tmp_path / "cut", method, max_steps=8, save_every=4), target, samples,
                      resume=True).run()
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5, abs=1e-6)


def test_reduced_dflash_trains_on_its_rows_and_counts_the_labels_outside(learned_target, training_data, tmp_path):
    from blockspec.models.dflash.checkpoint import load_dflash_model

    target, _, _ = learned_target
    samples, _ = training_data
    trainer = Trainer(method_config(tmp_path, "dflash-reduced", max_steps=3), target, samples)
    trainer.run()
    model = trainer.model
    assert model.compressed and model.lm_head.weight.shape[0] == 40 and not model.lm_head.weight.requires_grad
    head = target.model.get_output_embeddings().weight
    assert torch.equal(model.lm_head.weight, head[model.draft_to_target].float())  # the target's rows, frozen
    assert 0 < trainer.method.outside < trainer.method.positions  # 40 rows leave some labels out
    assert "masked from the loss" in trainer.method.summary()
    assert load_dflash_model(tmp_path / "draft").draft_to_target.tolist() == model.draft_to_target.tolist()


def test_the_draft_vocabulary_is_the_most_frequent_response_tokens():
    from blockspec.training.samples import TrainingSample

    ids = torch.tensor([9, 9, 9, 5, 5, 7, 7, 7, 7, 3])
    mask = torch.tensor([True] * 3 + [False] * 2 + [True] * 5)
    sample = TrainingSample(ids, mask)
    assert frequent_tokens([sample], 2).tolist() == [7, 9]
    assert frequent_tokens([sample], 3, always=[1]).tolist() == [1, 7, 9]
    assert frequent_tokens([sample], 5).tolist() == [0, 3, 5, 7, 9]  # then prompt tokens, then low ids


def test_cli_trains_and_generates_with_each_method(learned_target, tmp_path, capsys):
    import json

    from blockspec.cli import main

    _, target_dir, prompts = learned_target
    for method in ("eagle3", "mtp", "draft"):
        out = tmp_path / method
        code = main(["train-draft", "--method", method, "--target", str(target_dir), "--data", str(prompts),
                     "--out", str(out), "--max-steps", "3", "--batch-size", "2", "--max-new-tokens", "8",
                     "--num-layers", "1", "--draft-vocab-size", "100", "--ttt-steps", "2"])
        assert code == 0
        capsys.readouterr()
        assert main(["generate", "--target", str(target_dir), "--draft", str(out / "draft"), "--json",
                     "--max-new-tokens", "8", "The quick"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["method"] == method and 1 <= len(result["token_ids"]) <= 8


@pytest.mark.parametrize("arch", TWO_FAMILIES)
def test_the_draft_lm_loss_scores_only_supervised_positions_exactly(arch, tmp_path):
    """The loss through the head on the supervised rows equals the cross entropy of the whole logits."""
    import torch.nn.functional as F

    from blockspec.training.methods import Batch, DraftModelTraining, shrink_target
    from blockspec.training.samples import TrainingSample, pad_batch
    from helpers import make_causal_lm, make_tokenizer

    model = make_causal_lm(arch, vocab_size=320).double()
    target = Target(model=model, tokenizer=make_tokenizer(), name="tiny")
    draft = shrink_target(model, 2).double()
    generator = torch.Generator().manual_seed(0)
    samples = [TrainingSample(torch.randint(4, 320, (n,), generator=generator),
                              torch.arange(n) >= prompt) for n, prompt in ((20, 5), (13, 9), (31, 2))]
    ids, mask, lengths = pad_batch(samples)
    batch = Batch([0, 1, 2], ids, mask, lengths, None)
    loss, _ = DraftModelTraining().loss(draft, draft, batch, target, small_config(tmp_path, method="draft"), None)
    attention = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    logits = draft(input_ids=ids, attention_mask=attention).logits[:, :-1]
    expected = F.cross_entropy(logits[mask[:, 1:]].float(), ids[:, 1:][mask[:, 1:]])
    torch.testing.assert_close(loss, expected)


def test_dspark_heads_learn_on_a_frozen_dflash_backbone(learned_target, training_data, tmp_path):
    """train-draft --method dspark --init-from DFLASH --freeze-backbone: the heads learn, the backbone stays the
    DFlash drafter's weight for weight, and the DSpark drafter it writes is lossless."""
    from blockspec.models.dflash.checkpoint import load_dflash_model

    target, _, _ = learned_target
    samples, eval_prompts = training_data
    Trainer(small_config(tmp_path / "dflash", method="dflash", max_steps=60, anchors_per_sequence=12), target,
            samples).run()
    backbone = load_dflash_model(tmp_path / "dflash" / "draft").state_dict()
    config = small_config(tmp_path / "dspark", method="dspark", init_from=str(tmp_path / "dflash" / "draft"),
                          freeze_backbone=True, markov_rank=16, max_steps=40, anchors_per_sequence=12)
    trainer = Trainer(config, target, samples, eval_prompts)
    initial_head = trainer.model.markov_head.markov_w2.weight.detach().clone()
    state = trainer.run()
    assert sum(state.losses[-5:]) / 5 < 0.9 * sum(state.losses[:5]) / 5
    assert detect_method(tmp_path / "dspark" / "draft") == "dspark"
    saved = load_dflash_model(tmp_path / "dspark" / "draft")
    weights = saved.state_dict()
    assert all(torch.equal(weights[name], value) for name, value in backbone.items())
    assert not torch.equal(weights["markov_head.markov_w2.weight"], initial_head)
    assert saved.confidence_head is not None and not saved.anchor_predicts
    reference = Target(copy.deepcopy(target.model).double(), target.tokenizer, "learned-fp64")
    drafter = build_drafter("dspark", reference, str(tmp_path / "dspark" / "draft"))
    for ids in eval_prompts:
        plain = speculative_generate(reference.model, ids, None, GenerationConfig(max_new_tokens=24))
        list(plain)
        for options in ({"block_size": 8}, {"tree_budget": 8}):
            stream = speculative_generate(reference.model, ids, drafter, GenerationConfig(max_new_tokens=24, **options))
            list(stream)
            assert stream.token_ids == plain.token_ids


@pytest.mark.parametrize("overrides,message", [
    ({"method": "dflash", "markov_rank": 8}, "--markov-rank is a dspark switch"),
    ({"method": "dflash", "freeze_backbone": True}, "--freeze-backbone is a dspark switch"),
    ({"method": "dspark", "markov_rank": 0}, "markov_rank must be >= 1"),
])
def test_dspark_switches_are_refused_where_they_mean_nothing(tmp_path, overrides, message):
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match=message):
        small_config(tmp_path, **overrides)


def test_a_frozen_backbone_needs_one_to_start_from(learned_target, training_data, tmp_path):
    from blockspec.errors import BlockspecError

    target, _, _ = learned_target
    samples, _ = training_data
    with pytest.raises(BlockspecError, match="--freeze-backbone trains the heads on a trained backbone"):
        Trainer(small_config(tmp_path, method="dspark", freeze_backbone=True), target, samples)
