"""Masked diffusion training: the loss, the noise, shifted reads, block-causal attention,
adaptation, exact resume, safe checkpoints, the data, loading by path, the CLI."""

import json
import math
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from blockspec.cli import main
from blockspec.dllm import train as train_module
from blockspec.dllm.model import (
    BLOCK_CAUSAL,
    additive_mask,
    answer_blocks,
    block_causal_mask,
    block_diffusion_training_mask,
    config_mask_token_id,
    load_diffusion_model,
)
from blockspec.dllm.train import (
    DiffusionTrainConfig,
    DiffusionTrainer,
    TokenBatch,
    add_mask_noise,
    collate,
    diffusion_inputs,
    load_training_samples,
    maskable_positions,
    masked_diffusion_loss,
    model_loss,
    prediction_source,
    training_blocks,
)
from blockspec.errors import BlockspecError
from blockspec.training.checkpoints import KEEP_CHECKPOINTS, latest_checkpoint
from blockspec.training.samples import TrainingSample
from helpers import CORPUS, make_causal_lm, make_tokenizer, save_tiny_target

# --- the loss -------------------------------------------------------------------------------

LOGITS = [[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0], [1.0, -2.0, 0.0]],
          [[0.0, 1.0, 0.0], [-1.0, 2.0, 1.0], [3.0, 0.0, 0.0]]]
TARGETS = [[0, 2, 1], [1, 0, 0]]
MASKED = [[True, False, True], [False, True, True]]
RATES = [0.5, 0.25]


def hand_cross_entropy(row, target):
    return math.log(sum(math.exp(v) for v in row)) - row[target]


def test_the_loss_equals_a_hand_computed_value():
    weighted = [[hand_cross_entropy(LOGITS[b][i], TARGETS[b][i]) / RATES[b] if MASKED[b][i] else 0.0
                 for i in range(3)] for b in range(2)]
    pretraining = sum(map(sum, weighted)) / (2 * 3)
    response_lengths = [2, 3]
    sft = sum(sum(weighted[b]) / response_lengths[b] for b in range(2)) / 2

    logits, targets = torch.tensor(LOGITS), torch.tensor(TARGETS)
    masked, rates = torch.tensor(MASKED), torch.tensor(RATES)
    assert masked_diffusion_loss(logits, targets, masked, rates).item() == pytest.approx(pretraining, rel=1e-6)
    got = masked_diffusion_loss(logits, targets, masked, rates, response_lengths=torch.tensor([2.0, 3.0]))
    assert got.item() == pytest.approx(sft, rel=1e-6)
    only_masked = masked_diffusion_loss(logits[masked], targets, masked, rates)  # [N, V], as the trainer feeds it
    assert only_masked.item() == pytest.approx(pretraining, rel=1e-6)


def token_batch(lengths, prompt_lengths, width=None):
    samples = []
    for n, p in zip(lengths, prompt_lengths):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[p:] = True
        samples.append(TrainingSample(torch.arange(10, 10 + n), mask))
    return collate(samples, pad_id=0)


def test_sft_never_masks_the_prompt_nor_padding():
    batch = token_batch([12, 9], [5, 3])
    maskable = maskable_positions(batch, sft=True, shifted=True)
    assert torch.equal(maskable, batch.response_mask)
    ever_masked = torch.zeros_like(maskable)
    for seed in range(50):
        noised = add_mask_noise(batch.input_ids, maskable, 1, generator=torch.Generator().manual_seed(seed))
        ever_masked |= noised.masked
        assert torch.equal(noised.noisy_ids[~noised.masked], batch.input_ids[~noised.masked])
        assert (noised.noisy_ids[noised.masked] == 1).all()
    assert torch.equal(ever_masked, batch.response_mask)  # the whole response, never anything else


def test_pretraining_masks_the_prompt_too_but_never_the_first_token_when_shifted():
    batch = token_batch([12, 9], [5, 3])
    assert torch.equal(maskable_positions(batch, sft=False, shifted=False), batch.valid)
    shifted = maskable_positions(batch, sft=False, shifted=True)
    assert not shifted[:, 0].any() and torch.equal(shifted[:, 1:], batch.valid[:, 1:])


def test_the_noise_masks_about_t_of_the_tokens():
    ids = torch.randint(5, 100, (8, 4000), generator=torch.Generator().manual_seed(0))
    noised = add_mask_noise(ids, torch.ones_like(ids, dtype=torch.bool), 1, eps=1e-3,
                            generator=torch.Generator().manual_seed(1))
    assert ((noised.p_mask >= 1e-3) & (noised.p_mask <= 1)).all()
    fractions = noised.masked.float().mean(dim=1)
    assert torch.allclose(fractions, noised.p_mask, atol=0.03)
    gaps = noised.p_mask.sort().values.diff()  # stratified: the rates cover [0, 1] evenly
    assert torch.allclose(gaps, torch.full_like(gaps, (1 - 1e-3) / 8), atol=1e-5)


# --- which hidden state predicts which token ------------------------------------------------

class NamesTheRowItReadsFrom(torch.nn.Module):
    """A stand-in LM whose hidden state at row r of the fed sequence is one-hot(r), read out by
    a sharp identity head: a prediction for token i is right exactly when token i == its row."""

    def __init__(self, vocab):
        super().__init__()
        self.head = torch.nn.Linear(vocab, vocab, bias=False)
        self.head.weight.data = 30 * torch.eye(vocab)
        self.config = SimpleNamespace()
        self.vocab = vocab

    @property
    def base_model(self):
        return self

    def forward(self, input_ids, attention_mask, position_ids):
        rows = torch.arange(input_ids.shape[1])
        hidden = torch.nn.functional.one_hot(rows, self.vocab).float().expand(input_ids.shape[0], -1, -1)
        return SimpleNamespace(last_hidden_state=hidden)

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("attention,shifted,expected_rows", [
    ("bidirectional", False, [0, 1, 2, 3, 4, 5, 6, 7]),
    ("bidirectional", True, [0, 0, 1, 2, 3, 4, 5, 6]),  # token i is read at i-1 (token 0 is never masked)
    ("block_causal", False, [0, 1, 2, 3, 4, 5, 6, 7]),
    # pre-training (no prompt): blocks of 4 from position 0 in a doubled sequence of 16; token 4
    # opens the second block and is read at the clean copy of 3 (8 + 3)
    ("block_causal", True, [0, 0, 1, 2, 8 + 3, 4, 5, 6]),
])
def test_each_prediction_is_read_where_inference_can_read_it(attention, shifted, expected_rows):
    length, mask_id = 8, 17
    rows = torch.tensor(expected_rows)
    positions = torch.arange(1 if shifted else 0, length)
    opens = positions % 4 == 0 if attention == BLOCK_CAUSAL else None
    assert torch.equal(prediction_source(positions, length, shifted=shifted, opens_block=opens),
                       rows[1 if shifted else 0:])
    batch = collate([TrainingSample(rows, torch.ones(length, dtype=torch.bool))], pad_id=0)
    config = DiffusionTrainConfig(out="unused", sft=False, shifted=shifted, attention=attention, block_size=4)
    model = NamesTheRowItReadsFrom(vocab=18)
    losses = [model_loss(model, batch, mask_id, config, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    assert max(losses) < 1e-6
    wrong = collate([TrainingSample((rows + 1) % 16, torch.ones(length, dtype=torch.bool))], pad_id=0)
    assert max(model_loss(model, wrong, mask_id, config, generator=torch.Generator().manual_seed(s))
               for s in range(5)) > 1


# --- block-causal attention -----------------------------------------------------------------

def test_the_prompt_is_block_zero_and_answer_blocks_start_at_the_answer():
    batch = token_batch([8, 6], [3, 0])
    assert training_blocks(batch, 2).tolist() == [[0, 0, 0, 1, 1, 2, 2, 3], [1, 1, 2, 2, 3, 3, 4, 4]]
    assert answer_blocks(torch.tensor([3]), 8, 2).tolist() == [[0, 0, 0, 1, 1, 2, 2, 3]]  # as the sampler cuts it


def test_the_block_diffusion_mask_entry_by_entry():
    length, size = 5, 2  # blocks 0 0 1 1 2 (the last one short)
    mask = block_diffusion_training_mask(torch.arange(length) // size)
    assert mask.shape == (10, 10) and mask.dtype == torch.bool
    block = [0, 0, 1, 1, 2]
    for q in range(10):
        for k in range(10):
            q_noisy, k_noisy = q < length, k < length
            bq, bk = block[q % length], block[k % length]
            if q_noisy and k_noisy:
                expected = bq == bk  # its own noisy block, both ways
            elif q_noisy:
                expected = bk < bq  # clean blocks before its own
            elif k_noisy:
                expected = False  # the clean copy never sees noise
            else:
                expected = bk <= bq  # causal over clean blocks
            assert bool(mask[q, k]) == expected, (q, k)
    assert torch.equal(block_diffusion_training_mask(torch.tensor([0, 0, 1, 1])).int(), torch.tensor([
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]))
    # the clean quadrant is the inference mask (the block being denoised sees itself and earlier blocks)
    blocks = torch.tensor(block)
    assert torch.equal(mask[length:, length:], block_causal_mask(blocks, blocks))


def test_padding_keys_are_hidden_in_both_copies():
    batch = token_batch([6, 4], [1, 1])
    ids, positions, visible = diffusion_inputs(batch.input_ids, batch, attention=BLOCK_CAUSAL, block_size=2)
    assert ids.shape == (2, 12) and torch.equal(positions[:, :6], positions[:, 6:])
    assert visible.shape == (2, 1, 12, 12)
    assert not visible[1, 0, :, [4, 5, 10, 11]].any()
    assert torch.equal(visible[0, 0], block_diffusion_training_mask(training_blocks(batch, 2)[0]))


def hidden_states(model, ids, batch, attention, block_size=2):
    inputs, positions, visible = diffusion_inputs(ids, batch, attention=attention, block_size=block_size)
    with torch.no_grad():
        return model.base_model(input_ids=inputs, position_ids=positions,
                                attention_mask=additive_mask(visible, torch.float32)).last_hidden_state[0]


def test_the_attention_mask_reaches_the_model():
    model = make_causal_lm(num_hidden_layers=2)
    batch = token_batch([8], [1])
    before = hidden_states(model, batch.input_ids, batch, "bidirectional")
    changed = batch.input_ids.clone()
    changed[0, 7] = 99
    after = hidden_states(model, changed, batch, "bidirectional")
    assert not torch.allclose(before[0], after[0])  # the first token sees the last one

    clean = TokenBatch(changed, batch.valid, batch.response_mask, batch.position_ids)
    before = hidden_states(model, batch.input_ids, batch, BLOCK_CAUSAL)
    after = hidden_states(model, batch.input_ids, clean, BLOCK_CAUSAL)  # clean token 7 (block 3) changed
    assert torch.allclose(before[:8], after[:8])  # no noisy block sees clean block 3
    assert torch.allclose(before[8:14], after[8:14]) and not torch.allclose(before[14:], after[14:])


# --- adaptation -----------------------------------------------------------------------------

def write_prompts(path: Path) -> Path:
    rows = [{"question": s[:n], "answer": s[n:]} for s in CORPUS[:6] for n in range(8, 32, 4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def samples(tokenizer, tmp_path_factory):
    return load_training_samples([write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")], tokenizer,
                                 max_length=64)


def small_config(out, **overrides):
    values = dict(out=str(out), steps=8, batch_size=4, lr=3e-3, block_size=8, save_every=0, progress=False)
    values.update(overrides)
    return DiffusionTrainConfig(**values)


def fresh_model():
    return make_causal_lm(initializer_range=0.02, num_hidden_layers=2)


@pytest.mark.parametrize("attention", ["bidirectional", "block_causal"])
def test_adaptation_lowers_the_loss(attention, tokenizer, samples, tmp_path):
    config = small_config(tmp_path, steps=40, batch_size=8, attention=attention)
    losses = DiffusionTrainer(config, fresh_model(), tokenizer, samples).run().losses
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10


def test_the_saved_model_loads_with_its_diffusion_settings(tokenizer, samples, tmp_path):
    config = small_config(tmp_path, steps=2, attention="block_causal", block_size=4)
    trainer = DiffusionTrainer(config, fresh_model(), tokenizer, samples)
    trainer.run()
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["dllm"] == {"mask_token_id": trainer.mask_token_id, "shifted": True, "attention": "block_causal",
                             "block_size": 4}
    model, loaded_tokenizer = load_diffusion_model(tmp_path / "model", device="cpu")
    assert (model.mask_token_id, model.shifted, model.attention, model.block_size) == (
        tokenizer.convert_tokens_to_ids("<|mask|>"), True, "block_causal", 4)
    assert len(loaded_tokenizer) == len(tokenizer)
    ids = torch.tensor([[5, 6, 7, model.mask_token_id]])
    visible = block_causal_mask(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))[None, None]
    logits = model.logits(ids, position_ids=torch.arange(4)[None], attention_mask=visible)
    assert logits.shape == (1, 4, len(tokenizer))


# --- resume and checkpoints -----------------------------------------------------------------

def interrupt_during_the_forward(trainer, monkeypatch, at_step):
    real = train_module.model_loss

    def loss_or_ctrl_c(*args, **kwargs):
        if trainer.state.step == at_step:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "model_loss", loss_or_ctrl_c)
    return at_step  # nothing of the step was applied


def ctrl_c_during_the_update(trainer, monkeypatch, at_step):
    real = torch.nn.utils.clip_grad_norm_

    def clip_with_ctrl_c(*args, **kwargs):  # the first thing the update does
        if trainer.state.step == at_step:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_with_ctrl_c)
    return at_step + 1  # Ctrl-C is held until the step is whole


@pytest.mark.parametrize("interrupt", [interrupt_during_the_forward, ctrl_c_during_the_update])
def test_an_interrupted_and_resumed_run_reproduces_the_losses(interrupt, tokenizer, samples, tmp_path,
                                                              monkeypatch):
    overrides = dict(steps=8, save_every=3, attention="block_causal", seed=3)
    whole = DiffusionTrainer(small_config(tmp_path / "whole", **overrides), fresh_model(), tokenizer, samples).run()
    cut = DiffusionTrainer(small_config(tmp_path / "cut", **overrides), fresh_model(), tokenizer, samples)
    saved_step = interrupt(cut, monkeypatch, at_step=4)
    with pytest.raises(KeyboardInterrupt):
        cut.run()
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path / "cut").name == f"step-{saved_step:07d}"
    resumed = DiffusionTrainer(small_config(tmp_path / "cut", **overrides), fresh_model(), tokenizer, samples,
                               resume=True)
    assert resumed.state.step == saved_step
    assert resumed.run().losses == pytest.approx(whole.losses, rel=1e-6, abs=1e-7)
    assert len(list((tmp_path / "cut" / "checkpoints").glob("step-*"))) == KEEP_CHECKPOINTS  # older ones pruned


def test_resuming_with_other_settings_or_training_over_a_run_is_refused(tokenizer, samples, tmp_path):
    DiffusionTrainer(small_config(tmp_path, steps=2), fresh_model(), tokenizer, samples).run()
    with pytest.raises(BlockspecError, match="lr 0.003 -> 0.001"):
        DiffusionTrainer(small_config(tmp_path, steps=2, lr=1e-3), fresh_model(), tokenizer, samples, resume=True)
    with pytest.raises(BlockspecError, match="pass --resume"):
        DiffusionTrainer(small_config(tmp_path, steps=2), fresh_model(), tokenizer, samples)


def test_a_kill_mid_write_leaves_the_last_checkpoint_loadable(tokenizer, samples, tmp_path):
    trainer = DiffusionTrainer(small_config(tmp_path, save_every=2), fresh_model(), tokenizer, samples)
    trainer.run(until_step=2)
    child = os.fork()
    if child == 0:  # the run goes on and is killed (no clean-up runs) while it writes step 4
        def killed_half_way(obj, path, *args, **kwargs):
            Path(path).write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)

        train_module.torch.save = killed_half_way
        trainer.run(until_step=4)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    folder = tmp_path / "checkpoints"
    assert any(p.name.startswith(".step-0000004") for p in folder.iterdir())  # the half-written one
    assert latest_checkpoint(tmp_path).name == "step-0000002"
    model, _ = load_diffusion_model(latest_checkpoint(tmp_path), device="cpu")
    assert model.mask_token_id == trainer.mask_token_id
    resumed = DiffusionTrainer(small_config(tmp_path, save_every=2), fresh_model(), tokenizer, samples, resume=True)
    assert resumed.state.step == 2
    resumed.run(until_step=4)
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-0000002", "step-0000004"]


# --- data -----------------------------------------------------------------------------------

def test_prompt_files_give_prompt_and_response_ending_on_the_end_of_turn(tokenizer, samples):
    sample = samples[0]
    prompt_length = int((~sample.loss_mask).sum())
    text = tokenizer.decode(sample.input_ids[:prompt_length])
    assert text.startswith("<|im_start|>user\nThe quic") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(sample.input_ids[prompt_length:]) == "k brown fox jumps over the lazy dog.<|im_end|>"
    assert sample.loss_mask[prompt_length:].all()


@pytest.mark.parametrize("content,message", [
    ("", "is empty"),
    ('{"question": "What is 2 + 2?"}\n{"prompt": "Say hi"}\n', "gives no prompt/response pair"),
    ('{"question": "x"\n', "malformed JSON"),
])
def test_bad_data_is_a_clear_error(content, message, tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(BlockspecError, match=message):
        load_training_samples([path], tokenizer)
    with pytest.raises(BlockspecError, match="not found"):
        load_training_samples([tmp_path / "missing.jsonl"], tokenizer)


def test_response_caches_are_read_as_they_are(tokenizer, tmp_path):
    cache = tmp_path / "responses.jsonl"
    record = {"id": "a:0", "prompt_ids": [5, 6, 7], "response_ids": [8, 9], "finished": True}
    cache.write_text(json.dumps(record) + "\n")
    [sample] = load_training_samples([cache], tokenizer)
    assert sample.input_ids.tolist() == [5, 6, 7, 8, 9] and sample.loss_mask.tolist() == [0, 0, 0, 1, 1]


def test_bad_settings_are_clear_errors():
    with pytest.raises(BlockspecError, match="attention must be one of"):
        DiffusionTrainConfig(out="x", attention="causal")
    with pytest.raises(BlockspecError, match="block_size must be >= 1"):
        DiffusionTrainConfig(out="x", block_size=0)


# --- loading checkpoints by path ------------------------------------------------------------

LLADA_CONFIG = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "mask_token_id": 126336,
                "vocab_size": 126464, "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"}}
DREAM_CONFIG = {"architectures": ["DreamModel"], "model_type": "Dream", "mask_token_id": 151666,
                "vocab_size": 152064, "auto_map": {"AutoModel": "modeling_dream.DreamModel"}}


@pytest.mark.parametrize("config", [LLADA_CONFIG, DREAM_CONFIG])
def test_llada_and_dream_need_trust_remote_code(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BlockspecError, match="--trust-remote-code"):
        load_diffusion_model(tmp_path)
    assert config_mask_token_id(config) == config["mask_token_id"]


def test_a_plain_causal_lm_needs_a_mask_token(tmp_path):
    directory = save_tiny_target(tmp_path / "plain")
    with pytest.raises(BlockspecError, match="--mask-token-id"):
        load_diffusion_model(directory, device="cpu")
    with pytest.raises(BlockspecError, match="outside the vocabulary"):
        load_diffusion_model(directory, device="cpu", mask_token_id=10_000)
    model, _ = load_diffusion_model(directory, device="cpu", mask_token_id=3)
    assert (model.mask_token_id, model.shifted, model.attention, model.block_size) == (3, False, "bidirectional",
                                                                                       None)


# --- the command line -----------------------------------------------------------------------

def test_dllm_train_from_the_command_line(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "run"
    args = ["dllm", "train", "--init", str(target), "--data", str(prompts), "--out", str(out), "--steps", "3",
            "--batch-size", "2", "--max-length", "48", "--attention", "block_causal", "--block-size", "8",
            "--lr", "1e-3", "--save-every", "2"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert f"saved the diffusion model to {out / 'model'}" in captured.out
    assert "(mean of the first 1 steps) ->" in captured.err and "s/step" in captured.err
    settings = json.loads((out / "model" / "config.json").read_text())["dllm"]
    assert settings["attention"] == "block_causal" and settings["block_size"] == 8 and settings["shifted"]
    assert main(args) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0


def test_dllm_train_reports_bad_data_in_one_line(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["dllm", "train", "--init", str(target), "--data", str(empty), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and "is empty" in err and "Traceback" not in err
