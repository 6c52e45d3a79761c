import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)  # tiny models run fastest on one thread

from tiny_models import make_causal_lm, save_tiny_target  # noqa: E402

from blockspec.models.dflash import DFlashDraftModel, make_dflash_config  # noqa: E402


def make_dflash(target, num_layers=2, block_size=16, mask_token_id=3, seed=1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = make_dflash_config(target.config, num_layers=num_layers, block_size=block_size,
                                mask_token_id=mask_token_id)
    return DFlashDraftModel(config).to(next(target.parameters()).dtype).eval()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"), arch="llama")


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_target_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from blockspec.models.dflash import save_dflash_model

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    directory = tmp_path_factory.mktemp("tiny-draft") / "draft"
    save_dflash_model(make_dflash(target, block_size=8), directory)
    return directory
