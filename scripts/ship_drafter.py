"""Copy a trained drafter into the package's assets, its floating-point weights rounded to bf16.

Half the size of the fp32 files the trainer writes; blockspec loads the weights back in fp32. Integer
tensors (a reduced vocabulary's ``d2t``) are copied as they are. The copy replaces DST atomically.
``--without-embeddings`` drops a draft LM's embeddings and tied LM head (frozen copies of the
target's, 28M values for SmolLM2): blockspec fills them from the target when it loads the draft.

    .venv/bin/python scripts/ship_drafter.py runs/dflash-smollm2-v3/draft blockspec/assets/dflash-smollm2-135m
    .venv/bin/python scripts/ship_drafter.py --without-embeddings runs/draft-smollm2/draft \
        blockspec/assets/draft-smollm2-135m
"""

import argparse
import json
import shutil
from pathlib import Path

import safetensors.torch as st
import torch

from blockspec.io import save_atomically

COPIED = ("mask_embedding.pt",)
EMBEDDINGS = ("embed_tokens.weight", "lm_head.weight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a drafter directory written by train-draft")
    parser.add_argument("destination", type=Path)
    parser.add_argument("--without-embeddings", action="store_true",
                        help="drop a draft LM's embeddings and tied head (the target's, filled in at load)")
    args = parser.parse_args()
    weights = st.load_file(args.source / "model.safetensors")
    config = json.loads((args.source / "config.json").read_text())
    if args.without_embeddings:
        if not config.get("tie_word_embeddings", False) and "lm_head.weight" in weights:
            raise SystemExit("the draft's LM head is not tied to its embeddings: it may be trained, keep it "
                             "(drop only the embeddings by hand)")
        weights = {name: tensor for name, tensor in weights.items() if not name.endswith(EMBEDDINGS)}
    rounded = {name: tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
               for name, tensor in weights.items()}
    config["dtype"] = "bfloat16"

    def write(directory):
        directory = Path(directory)
        st.save_file(rounded, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in COPIED:
            if (args.source / name).is_file():
                shutil.copy(args.source / name, directory / name)

    save_atomically(write, args.destination)
    print(f"{args.destination}: {sum(t.numel() for t in weights.values()) / 1e6:.1f}M values, "
          f"{(args.destination / 'model.safetensors').stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
