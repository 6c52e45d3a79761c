"""The DFlash trainer: anchors and masks, learning, exact resume, safe checkpoints, DDP."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockspec.models.dflash.checkpoint import load_dflash_model
from blockspec.tokens import pick_mask_token
from blockspec.training import trainer as trainer_module
from blockspec.training.anchors import build_blocks, loss_weights
from blockspec.training.checkpoints import latest_checkpoint
from blockspec.training.samples import TrainingSample, pad_batch
from blockspec.training.trainer import TrainConfig, Trainer
from helpers import first_response_cache, make_tokenizer, small_config

# --- anchors, labels, weights and the block-sparse mask ------------------------------------

def test_loss_weights_decay_and_skip_the_anchor():
    w = loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.allclose(w[8], torch.exp(torch.tensor(-1.0)))
    assert torch.equal(loss_weights(4, None), torch.tensor([0.0, 1, 1, 1]))


def test_blocks_see_the_context_before_their_anchor_and_their_own_block():
    ids = torch.arange(100, 130).unsqueeze(0)
    loss_mask = torch.zeros(1, 30, dtype=torch.bool)
    loss_mask[0, 10:] = True
    blocks = build_blocks(ids, loss_mask, torch.tensor([30]), block_size=4, num_anchors=3, mask_token_id=7,
                          gamma=None, generator=torch.Generator().manual_seed(0))
    mask = blocks.attention_mask[0, 0]
    for slot in range(3):
        span = range(slot * 4, slot * 4 + 4)
        anchor = int(blocks.block_positions[0, slot * 4])
        assert anchor >= 9  # the next token (anchor + 1) is a response token
        assert blocks.block_ids[0, slot * 4] == ids[0, anchor]
        assert (blocks.block_ids[0, slot * 4 + 1: slot * 4 + 4] == 7).all()
        for q in span:
            assert mask[q, :anchor].all() and not mask[q, anchor:30].any()
            own = torch.zeros(12, dtype=torch.bool)
            own[slot * 4: slot * 4 + 4] = True
            assert torch.equal(mask[q, 30:], own)
        for k in range(1, 4):
            position = slot * 4 + k
            assert blocks.labels[0, position] == ids[0, anchor + k]
            assert blocks.weights[0, position] == (1.0 if anchor + k < 30 else 0.0)
        assert blocks.weights[0, slot * 4] == 0


def test_fixed_blocks_tile_the_response():
    loss_mask = torch.zeros(1, 40, dtype=torch.bool)
    loss_mask[0, 8:] = True
    blocks = build_blocks(torch.arange(40).unsqueeze(0), loss_mask, torch.tensor([40]), block_size=8,
                          num_anchors=10, mask_token_id=0, gamma=4.0, generator=torch.Generator().manual_seed(0),
                          random_anchors=False)
    anchors = blocks.block_positions[0, ::8][blocks.weights[0].view(10, 8).sum(1) > 0].tolist()
    assert anchors == [7, 15, 23, 31]


def test_a_training_block_gives_the_logits_the_drafter_computes_at_inference(learned_target, training_data):
    """The block-sparse training forward and the cached inference pass agree, anchor by anchor."""
    import copy

    from blockspec.drafters.dflash import DFlashDrafter
    from blockspec.training.features import FeatureSource
    from blockspec.training.methods import DFlashTraining

    target, _, _ = learned_target
    samples, _ = training_data
    config = TrainConfig(out="unused", num_layers=2, block_size=8)
    torch.manual_seed(0)
    model = DFlashTraining().build(config, target, samples).eval()
    rows = [samples[0], samples[3]]
    ids, loss_mask, lengths = pad_batch(rows)
    assert lengths[0] != lengths[1]  # one row is padded
    features = FeatureSource(target.model, model.target_layer_ids, keep=False)([0, 1], ids, lengths)
    blocks = build_blocks(ids, loss_mask, lengths, block_size=8, num_anchors=4, mask_token_id=model.mask_token_id,
                          gamma=7.0, generator=torch.Generator().manual_seed(1))
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    with torch.no_grad():
        hidden = model(embed(blocks.block_ids), blocks.block_positions, features, blocks.context_positions,
                       attention_mask=blocks.attention_mask)
        training_logits = head(hidden)
    drafter = DFlashDrafter(copy.deepcopy(model), target.model)
    checked = 0
    for row in range(2):
        for slot in range(4):
            if blocks.weights[row, slot * 8: slot * 8 + 8].sum() == 0:
                continue
            anchor = int(blocks.block_positions[row, slot * 8])
            state = drafter.start(ids[row:row + 1, :anchor], features[row:row + 1, :anchor])
            inference = drafter.draft_logits(state, int(ids[row, anchor]), 7)
            torch.testing.assert_close(inference, training_logits[row, slot * 8 + 1: slot * 8 + 8],
                                       rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 6


def test_the_loss_over_supervised_positions_equals_the_loss_over_the_whole_block():
    from blockspec.training.methods import block_loss
    from blockspec.training.vocab_loss import head_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 16, generator=generator)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=generator))
    labels = torch.randint(0, 50, (2, 24), generator=generator)
    weights = loss_weights(8, 4.0).repeat(2, 3)
    weights[1, 16:] = 0  # an unused slot
    supervised = weights > 0
    with torch.no_grad():
        logits = head(hidden)
    every_position = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), labels.flatten(), reduction="none")
    whole = (every_position * weights.flatten()).sum() / weights.sum()
    losses, hits = head_cross_entropy(head, hidden[supervised], labels[supervised])
    part, accuracy = block_loss(losses, hits, weights[supervised])
    torch.testing.assert_close(whole, part)
    assert accuracy == pytest.approx((logits.argmax(-1)[supervised] == labels[supervised]).float().mean().item())


def test_mask_token_is_a_spare_special_token():
    tokenizer = make_tokenizer()
    assert pick_mask_token(tokenizer, len(tokenizer)) == tokenizer.convert_tokens_to_ids("<|mask|>")


def test_training_lowers_the_loss_and_raises_tau(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, eval_prompts = training_data
    trainer = Trainer(small_config(tmp_path, max_steps=100, anchors_per_sequence=12), target, samples, eval_prompts)
    untrained = trainer.evaluate()["tau"]
    state = trainer.run()
    trained = trainer.evaluate()["tau"]
    assert sum(state.losses[-5:]) / 5 < 0.7 * sum(state.losses[:5]) / 5
    assert trained > untrained + 0.5, (untrained, trained)
    loaded = load_dflash_model(tmp_path / "draft")
    assert loaded.block_size == 8 and loaded.mask_token_id == pick_mask_token(target.tokenizer, 320)


def test_soft_labels_are_the_targets_own_predictions_of_the_block_tokens(learned_target, training_data, tmp_path):
    from blockspec.training.methods import teacher_states

    target, _, _ = learned_target
    samples, _ = training_data
    last = target.model.config.num_hidden_layers - 1
    config = small_config(tmp_path, target_layer_ids=[0, last], soft_labels=True, max_steps=2)
    trainer = Trainer(config, target, samples)
    ids, loss_mask, lengths = pad_batch(samples[:4])
    features = trainer.features([0, 1, 2, 3], ids, lengths)
    blocks = build_blocks(ids, loss_mask, lengths, block_size=8, num_anchors=6, mask_token_id=0, gamma=3.0,
                          generator=torch.Generator().manual_seed(0))
    supervised = blocks.weights > 0
    teacher = teacher_states(trainer.model, target, features, blocks.block_positions, supervised)
    predicted = target.model.get_output_embeddings()(teacher).argmax(-1)
    # the responses are the target's greedy output: its prediction at a+k-1 is the token at a+k
    assert supervised.sum() > 50
    assert (predicted == blocks.labels[supervised]).float().mean() > 0.97


def test_soft_labels_train_and_raise_tau(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, eval_prompts = training_data
    last = target.model.config.num_hidden_layers - 1
    config = small_config(tmp_path, max_steps=100, anchors_per_sequence=12, target_layer_ids=[0, last],
                          soft_labels=True)
    trainer = Trainer(config, target, samples, eval_prompts)
    untrained = trainer.evaluate()["tau"]
    state = trainer.run()
    assert sum(state.losses[-5:]) / 5 < 0.7 * sum(state.losses[:5]) / 5
    assert trainer.evaluate()["tau"] > untrained + 0.5


def test_soft_labels_need_the_targets_last_layer_and_dflash(learned_target, training_data, tmp_path):
    from blockspec.errors import BlockspecError

    target, _, _ = learned_target
    samples, _ = training_data
    with pytest.raises(BlockspecError, match="add 1 to --target-layers"):
        Trainer(small_config(tmp_path, target_layer_ids=[0], soft_labels=True), target, samples)
    with pytest.raises(BlockspecError, match="dflash switch"):
        small_config(tmp_path, method="eagle3", soft_labels=True)


def test_bf16_autocast_trains_close_to_fp32_with_fp32_weights(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    runs, autocast_seen = {}, {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(small_config(tmp_path / precision, max_steps=30, save_every=0, precision=precision),
                          target, samples)
        loss = trainer.method.loss

        def recording_loss(*args, _precision=precision, _loss=loss):
            autocast_seen[_precision] = torch.is_autocast_enabled("cpu")
            return _loss(*args)

        trainer.method.loss = recording_loss
        runs[precision] = (trainer, trainer.run())
    assert autocast_seen == {"fp32": False, "bf16": True}
    (_, fp32), (bf16_trainer, bf16) = runs["fp32"], runs["bf16"]
    assert all(p.dtype == torch.float32 for p in bf16_trainer.model.parameters())
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], rel=0.05)
    assert sum(bf16.losses[-5:]) < 0.8 * sum(bf16.losses[:5])
    assert sum(bf16.losses[-5:]) == pytest.approx(sum(fp32.losses[-5:]), rel=0.1)


def test_precision_is_checked():
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="precision must be one of"):
        TrainConfig(out="x", precision="fp16")


def test_interrupted_and_resumed_run_reproduces_the_losses(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    whole = Trainer(small_config(tmp_path / "whole", max_steps=12, save_every=4), target, samples).run()
    Trainer(small_config(tmp_path / "cut", max_steps=12, save_every=4), target, samples).run(until_step=6)
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000006"
    resumed = Trainer(small_config(tmp_path / "cut", max_steps=12, save_every=4), target, samples, resume=True).run()
    assert len(resumed.losses) == 12
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5, abs=1e-6)


def test_init_from_a_finished_drafter_continues_from_its_weights(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    first = Trainer(small_config(tmp_path / "first", max_steps=30), target, samples)
    first_state = first.run()
    fresh = Trainer(small_config(tmp_path / "fresh", max_steps=5), target, samples).run()
    starting_weights = str(tmp_path / "first" / "draft")
    continued_trainer = Trainer(small_config(tmp_path / "more", max_steps=5, init_from=starting_weights),
                                target, samples)
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(continued_trainer.model.state_dict()[name], tensor), name
    continued = continued_trainer.run()
    assert continued_trainer.state.step == 5  # a fresh schedule, not the first run's
    assert sum(continued.losses) < 0.8 * sum(fresh.losses)
    assert sum(continued.losses) / 5 < 1.2 * sum(first_state.losses[-5:]) / 5


def test_resume_takes_precedence_over_init_from(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    Trainer(small_config(tmp_path / "first", max_steps=4), target, samples).run()
    config = small_config(tmp_path / "more", max_steps=6, save_every=2, init_from=str(tmp_path / "first" / "draft"))
    Trainer(config, target, samples).run(until_step=2)
    shutil.rmtree(tmp_path / "first")  # the run's own checkpoint is all a resume needs
    resumed = Trainer(config, target, samples, resume=True)
    assert resumed.state.step == 2


def test_init_from_refuses_another_architecture(learned_target, training_data, tmp_path):
    from blockspec.errors import BlockspecError

    target, _, _ = learned_target
    samples, _ = training_data
    Trainer(small_config(tmp_path / "one-layer", max_steps=2), target, samples).run()
    with pytest.raises(BlockspecError, match="does not match the drafter this run builds.*layers.1"):
        Trainer(small_config(tmp_path / "two", num_layers=2, init_from=str(tmp_path / "one-layer" / "draft")),
                target, samples)
    with pytest.raises(BlockspecError, match="block_size is 8 there but 4 here"):
        Trainer(small_config(tmp_path / "four", block_size=4, init_from=str(tmp_path / "one-layer" / "draft")),
                target, samples)
    with pytest.raises(BlockspecError, match="no such directory"):
        Trainer(small_config(tmp_path / "x", init_from=str(tmp_path / "nowhere")), target, samples)


def test_grow_layers_starts_from_the_shallower_drafters_drafts_and_trains_the_new_layers(
        learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    layers = dict(target_layer_ids=[0, 1])
    shallow = Trainer(small_config(tmp_path / "one", max_steps=20, **layers), target, samples)
    shallow.run()
    grown = Trainer(small_config(tmp_path / "three", num_layers=3, max_steps=6, grow_layers=True,
                                 init_from=str(tmp_path / "one" / "draft"), **layers), target, samples)
    torch.manual_seed(3)
    hidden = target.model.config.hidden_size
    block, features = torch.randn(2, 8, hidden), torch.randn(2, 5, 2 * hidden)
    block_positions, context_positions = torch.arange(5, 13).expand(2, 8), torch.arange(5).expand(2, 5)
    with torch.no_grad():
        expected = shallow.model.eval()(block, block_positions, features, context_positions)
        before = grown.model.eval()(block, block_positions, features, context_positions)
    torch.testing.assert_close(before, expected, rtol=0, atol=0)
    for name, tensor in shallow.model.state_dict().items():
        assert torch.equal(grown.model.state_dict()[name], tensor), name
    losses = grown.run().losses
    assert all(math.isfinite(loss) for loss in losses)
    for layer in grown.model.layers[1:]:
        assert layer.self_attn.o_proj.weight.abs().sum() > 0 and layer.mlp.down_proj.weight.abs().sum() > 0
    reloaded = load_dflash_model(tmp_path / "three" / "draft")
    assert len(reloaded.layers) == 3


def test_grow_layers_is_refused_without_a_shallower_dflash_drafter(learned_target, training_data, tmp_path):
    from blockspec.errors import BlockspecError

    target, _, _ = learned_target
    samples, _ = training_data
    Trainer(small_config(tmp_path / "two", num_layers=2, max_steps=2), target, samples).run()
    with pytest.raises(BlockspecError, match="has 2 draft layers; --grow-layers needs fewer"):
        Trainer(small_config(tmp_path / "x", num_layers=2, grow_layers=True, init_from=str(tmp_path / "two" / "draft")),
                target, samples)
    with pytest.raises(BlockspecError, match="add --init-from"):
        small_config(tmp_path / "y", grow_layers=True)
    with pytest.raises(BlockspecError, match="--grow-layers is a dflash switch; method 'eagle3'"):
        small_config(tmp_path / "z", method="eagle3", grow_layers=True, init_from=str(tmp_path / "two" / "draft"))


def test_ctrl_c_saves_a_checkpoint(learned_target, training_data, tmp_path, monkeypatch):
    target, _, _ = learned_target
    samples, _ = training_data
    trainer = Trainer(small_config(tmp_path, save_every=0), target, samples)
    original = trainer._train_step

    def interrupt_at_three(step):
        if step == 3:
            raise KeyboardInterrupt
        return original(step)

    monkeypatch.setattr(trainer, "_train_step", interrupt_at_three)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert latest_checkpoint(tmp_path).name == "step-0000003"


def test_a_kill_mid_write_leaves_the_last_checkpoint_loadable(learned_target, training_data, tmp_path, monkeypatch):
    target, _, _ = learned_target
    samples, _ = training_data
    trainer = Trainer(small_config(tmp_path, save_every=2), target, samples)
    trainer.run(until_step=2)
    real_save = torch.save

    def dies_half_way(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise SystemExit("killed")

    monkeypatch.setattr(trainer_module.torch, "save", dies_half_way)
    with pytest.raises(SystemExit):
        trainer.run(until_step=4)
    monkeypatch.setattr(trainer_module.torch, "save", real_save)
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step-0000002"
    load_dflash_model(latest)
    leftovers = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert "step-0000004" not in leftovers
    resumed = Trainer(small_config(tmp_path, save_every=2), target, samples, resume=True)
    assert resumed.state.step == 2


def test_training_samples_exclude_held_out_prompts(training_data):
    samples, eval_prompts = training_data
    assert len(eval_prompts) == 4 and len(samples) == 97 - 4  # 120 rows, 23 duplicates


@pytest.mark.slow
def test_ddp_with_two_processes_on_cpu(learned_target, tmp_path):
    _, target_dir, prompts = learned_target
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
               "-m", "blockspec.cli", "train-draft", "--target", str(target_dir), "--data", str(prompts),
               "--out", str(tmp_path / "ddp"), "--num-layers", "1", "--block-size", "8", "--max-steps", "6",
               "--batch-size", "2", "--max-new-tokens", "16", "--anchors-per-sequence", "4", "--save-every", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step-0000006" / "trainer_state.json").read_text())
    assert len(state["losses"]) == 6
    load_dflash_model(tmp_path / "ddp" / "draft")


def test_empty_training_set_is_a_clear_error(learned_target, tmp_path):
    target, _, _ = learned_target
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="no training samples"):
        Trainer(small_config(tmp_path), target, [])
    assert isinstance(TrainingSample, type)


def test_chosen_target_layers_are_read_and_bad_ones_refused(learned_target, training_data, tmp_path):
    from blockspec.errors import IncompatibleDraftError

    target, _, _ = learned_target
    samples, _ = training_data
    layers = target.model.config.num_hidden_layers
    trainer = Trainer(small_config(tmp_path / "ok", target_layer_ids=[0, layers - 1], max_steps=2), target, samples)
    assert trainer.model.target_layer_ids == [0, layers - 1]
    assert trainer.features.layer_ids == [0, layers - 1]
    with pytest.raises(IncompatibleDraftError, match=f"outside the target's 0..{layers - 1}"):
        Trainer(small_config(tmp_path / "bad", target_layer_ids=[0, layers]), target, samples)


def test_target_layers_parse_from_the_command_line():
    import argparse

    from blockspec.cli.train import add_train_draft_command

    parser = argparse.ArgumentParser()
    add_train_draft_command(parser.add_subparsers())
    base = ["train-draft", "--target", "t", "--data", "d.jsonl", "--out", "o"]
    assert parser.parse_args(base + ["--target-layers", "1,15,29"]).target_layer_ids == [1, 15, 29]
    assert parser.parse_args(base).target_layer_ids is None
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--target-layers", "1,x"])


def test_several_response_caches_are_pooled(learned_target, tmp_path):
    """--responses cache with two files: their prompts train together, an id in both counts once."""
    from blockspec.errors import BlockspecError
    from blockspec.training.pipeline import DataConfig, prepare_samples
    from blockspec.training.response_cache import read_cache

    target, _, prompts = learned_target
    rows = [json.loads(line) for line in first_response_cache(learned_target, tmp_path).read_text().splitlines()]
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, part in ((first, rows[:10]), (second, rows[5:])):
        path.write_text("".join(json.dumps(row) + "\n" for row in part))
    data = DataConfig(files=[str(prompts)], responses="cache", cache=[str(first), str(second)], held_out=2)
    samples, held_out = prepare_samples(target, data, tmp_path / "out", max_length=256)
    assert sorted(s.id for s in samples) == sorted(row["id"] for row in rows)
    assert len(held_out) == 2 and len(read_cache(first)) == 10
    with pytest.raises(BlockspecError, match="several caches can only be read as they are"):
        prepare_samples(target, DataConfig(files=[str(prompts)], cache=[str(first), str(second)]),
                        tmp_path / "out", max_length=256)


def test_restyled_answers_train_with_their_records(learned_target, tmp_path):
    """A cache of the same prompts asked in other styles (ids ID@plain, ID@chat) joins its records' training."""
    from blockspec.training.pipeline import DataConfig, prepare_samples

    target, _, prompts = learned_target
    rows = [json.loads(line) for line in first_response_cache(learned_target, tmp_path).read_text().splitlines()]
    plain, styled = tmp_path / "a.jsonl", tmp_path / "styled.jsonl"
    plain.write_text("".join(json.dumps(row) + "\n" for row in rows))
    styled.write_text("".join(json.dumps({**row, "id": f"{row['id']}@{style}"}) + "\n"
                              for row in rows[:6] for style in ("plain", "chat")) +
                      json.dumps({**rows[0], "id": "elsewhere:0@chat"}) + "\n")
    data = DataConfig(files=[str(prompts)], responses="cache", cache=[str(plain), str(styled)], held_out=2)
    samples, _ = prepare_samples(target, data, tmp_path / "out", max_length=256)
    ids = sorted(s.id for s in samples)
    assert ids == sorted([row["id"] for row in rows] + [f"{row['id']}@{style}" for row in rows[:6]
                                                         for style in ("plain", "chat")])  # not another file's


def test_features_are_kept_in_bf16_under_bf16_autocast_and_come_back_as_float32(learned_target, training_data,
                                                                                    tmp_path):

    target, _, _ = learned_target
    samples, _ = training_data
    indices = [0, 1, 2]
    ids, _, lengths = pad_batch([samples[i] for i in indices])
    kept = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(small_config(tmp_path / precision, precision=precision), target, samples)
        with trainer._autocast():
            first = trainer.features(indices, ids, lengths)
        again = trainer.features(indices, ids, lengths)  # from the kept copies
        kept[precision] = trainer.features.kept[0].dtype
        assert first.dtype == again.dtype == torch.float32
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert kept == {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_the_memory_of_the_kept_features_is_known_before_the_run(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    one_epoch = math.ceil(len(samples) / 4)  # every sequence drawn once, so every one kept
    trainer = Trainer(small_config(tmp_path / "run", max_steps=one_epoch, save_every=0), target, samples)
    expected = trainer.kept_feature_bytes()
    trainer.run()
    kept = sum(t.numel() * t.element_size() for t in trainer.features.kept.values())
    assert len(trainer.features.kept) == len(samples) and kept == expected
    hidden = target.model.config.hidden_size
    assert expected == sum(s.input_ids.numel() for s in samples) * len(trainer.features.layer_ids) * hidden * 4
    one_step = Trainer(small_config(tmp_path / "short", max_steps=1, save_every=0), target, samples)
    per_token = one_step.features.bytes_per_token
    assert one_step.kept_feature_bytes() == pytest.approx(expected * 4 / len(samples), abs=per_token)
    for elsewhere in (dict(feature_cache_dir=str(tmp_path / "features")), dict(cache_features=False)):
        assert Trainer(small_config(tmp_path / "x", **elsewhere), target, samples).kept_feature_bytes() == 0


def test_kept_features_that_would_not_fit_in_memory_are_refused_at_the_start(learned_target, training_data,
                                                                             tmp_path, monkeypatch):
    import collections

    from blockspec.errors import BlockspecError

    target, _, _ = learned_target
    samples, _ = training_data
    needed = Trainer(small_config(tmp_path / "probe"), target, samples).kept_feature_bytes()
    memory = collections.namedtuple("memory", "available")
    monkeypatch.setattr("psutil.virtual_memory", lambda: memory(available=needed))  # no room for the steps
    with pytest.raises(BlockspecError, match=r"features in memory would take .* pass --feature-cache DIR .*"
                                             r"or --no-feature-cache"):
        Trainer(small_config(tmp_path / "run"), target, samples)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two DDP ranks on one machine keep twice as much
    monkeypatch.setattr("psutil.virtual_memory", lambda: memory(available=2 * needed))
    with pytest.raises(BlockspecError, match="features in memory"):
        Trainer(small_config(tmp_path / "ddp"), target, samples)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    Trainer(small_config(tmp_path / "fits"), target, samples)
    Trainer(small_config(tmp_path / "disk", feature_cache_dir=str(tmp_path / "features")), target, samples)
    Trainer(small_config(tmp_path / "recompute", cache_features=False), target, samples)


def _samples_seen(trainer) -> set[int]:
    return {i for step in range(trainer.total_steps) for i in trainer._batch_indices(step, 0)}


def test_features_kept_on_disk_train_exactly_as_in_memory_and_are_reused(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    store_dir = tmp_path / "features"
    in_memory = Trainer(small_config(tmp_path / "memory", max_steps=12, save_every=0), target, samples)
    expected = in_memory.run().losses
    first = Trainer(small_config(tmp_path / "disk", max_steps=12, save_every=0, feature_cache_dir=str(store_dir)),
                    target, samples)
    assert first.run().losses == expected
    assert not first.features.kept  # on disk instead of in memory
    assert len(first.features.store) == len(_samples_seen(first))
    again = Trainer(small_config(tmp_path / "again", max_steps=12, save_every=0, feature_cache_dir=str(store_dir)),
                    target, samples)
    again.features.model = None  # a forward of the target would fail: every feature must come from disk
    assert again.run().losses == expected


def test_a_feature_cache_of_other_target_layers_is_refused(learned_target, training_data, tmp_path):
    from blockspec.errors import BlockspecError

    target, _, _ = learned_target
    samples, _ = training_data
    store_dir = str(tmp_path / "features")
    Trainer(small_config(tmp_path / "a", target_layer_ids=[0], feature_cache_dir=store_dir), target, samples)
    with pytest.raises(BlockspecError, match=r"holds features of another target or setting \(differs in: layer_ids"):
        Trainer(small_config(tmp_path / "b", target_layer_ids=[1], feature_cache_dir=store_dir), target, samples)


def test_a_feature_cache_of_more_layers_serves_a_run_reading_some_of_them(learned_target, training_data, tmp_path):
    target, _, _ = learned_target
    samples, _ = training_data
    store_dir = str(tmp_path / "features")
    wide = Trainer(small_config(tmp_path / "wide", max_steps=6, save_every=0, target_layer_ids=[0, 1],
                                feature_cache_dir=store_dir), target, samples)
    wide.run()
    expected = Trainer(small_config(tmp_path / "memory", max_steps=6, save_every=0, target_layer_ids=[1]),
                       target, samples).run().losses
    narrow = Trainer(small_config(tmp_path / "narrow", max_steps=6, save_every=0, target_layer_ids=[1],
                                  feature_cache_dir=store_dir), target, samples)
    assert narrow.features.store.layer_ids == [0, 1]
    assert narrow.run().losses == pytest.approx(expected, rel=1e-5)
    # a sequence the store lacks is computed for every stored layer, so wider runs find it whole
    ids, _, lengths = pad_batch([samples[0]])
    narrow.features.store.path(samples[0].input_ids).unlink(missing_ok=True)
    one = narrow.features([0], ids, lengths)
    assert one.shape[-1] == target.model.config.hidden_size
    assert wide.features.store.load(samples[0].input_ids).shape[-1] == 2 * target.model.config.hidden_size
    torch.testing.assert_close(wide.features([0], ids, lengths)[..., one.shape[-1]:], one)


def test_an_unreadable_feature_file_is_recomputed(learned_target, training_data, tmp_path):

    target, _, _ = learned_target
    samples, _ = training_data
    trainer = Trainer(small_config(tmp_path / "run", feature_cache_dir=str(tmp_path / "features")), target, samples)
    ids, _, lengths = pad_batch([samples[0], samples[1]])
    computed = trainer.features([0, 1], ids, lengths)
    damaged = trainer.features.store.path(samples[0].input_ids)
    damaged.write_bytes(damaged.read_bytes()[:40])  # as a crash of another writer could not leave it, but a disk can
    again = trainer.features([0, 1], ids, lengths)
    torch.testing.assert_close(again, computed, rtol=0, atol=0)
    assert trainer.features.store.recomputed_unreadable == 1
    assert "1 unreadable files recomputed" in trainer.features.store.summary()
    assert trainer.features.store.load(samples[0].input_ids) is not None  # rewritten


def test_feature_cache_directory_with_caching_off_is_a_clear_error(tmp_path):
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="drop one of --feature-cache and --no-feature-cache"):
        TrainConfig(out=str(tmp_path), cache_features=False, feature_cache_dir=str(tmp_path / "f"))
