import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)  # tiny models run fastest on one thread

import json  # noqa: E402

from helpers import CORPUS, make_causal_lm, make_dflash, make_tokenizer, save_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"), arch="llama")


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_target_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from blockspec.models.dflash.checkpoint import save_dflash_model

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    directory = tmp_path_factory.mktemp("tiny-draft") / "draft"
    save_dflash_model(make_dflash(target, block_size=8), directory)
    return directory


# --- a tiny target that has learned something, so its outputs are learnable ---------------

@pytest.fixture(scope="session")
def learned_target(tmp_path_factory):
    """A tiny Llama trained for a few seconds to continue the corpus sentences."""
    from blockspec.models.target import Target

    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    model = make_causal_lm("llama", vocab_size=len(tokenizer), initializer_range=0.02, num_hidden_layers=2)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": s[:20]}], add_generation_prompt=True,
                                           return_dict=False) + tokenizer.encode(s) + [tokenizer.eos_token_id]
             for s in CORPUS[:6]]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        for ids in texts:
            batch = torch.tensor([ids])
            loss = model(batch, labels=batch).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    directory = tmp_path_factory.mktemp("learned") / "target"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    prompts = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [{"prompt": s[:n]} for s in CORPUS[:6] for n in range(6, 26)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return Target(model, tokenizer, "learned"), directory, prompts


@pytest.fixture(scope="session")
def training_data(learned_target, tmp_path_factory):
    from blockspec.training.pipeline import DataConfig, prepare_samples

    target, _, prompts = learned_target
    out = tmp_path_factory.mktemp("run")
    data = DataConfig(files=[str(prompts)], max_new_tokens=24, held_out=4)
    return prepare_samples(target, data, out, max_length=256)
