"""Write the example's data and base model (python make_data.py OUT_DIR), three prefixes for the job:

- OUT_DIR/texts/    the dataset: JSONL sentences from a tiny grammar (subject verb object.)
- OUT_DIR/heldout/  the evaluation set: more sentences of that grammar, never trained on (inputs.heldout)
- OUT_DIR/base/     the base model the job fine-tunes (inputs.base): the example's GPT-2 built from its config,
                    pre-trained briefly on the grammar's words in any order, saved with `save_pretrained`. It knows
                    the bytes of the words but not the sentences' order, so a fine-tune that starts from it begins
                    far below an untrained model's loss (ln 256) and still has something to learn.

No hub, no network: the weights come from this script alone (seeded, the same on every run).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SUBJECTS = ("the cat", "a dog", "the model", "my friend", "the node")
VERBS = ("sees", "trains", "likes", "checkpoints", "stages")
OBJECTS = ("the data", "a bird", "the cluster", "its loss", "the bucket")
PRETRAIN_STEPS = 60


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."


def word_salad(rng: random.Random) -> str:
    """The grammar's words in any order: the base model's pre-training text."""
    words = [word for phrase in SUBJECTS + VERBS + OBJECTS for word in phrase.split()]
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 7))) + "."


def write_texts(out: Path, files: int, lines: int, seed: int) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        with open(out / f"texts-{index}.jsonl", "w") as handle:
            for _ in range(lines):
                handle.write(json.dumps({"text": sentence(rng)}) + "\n")


def write_base_model(out: Path, seed: int = 2) -> None:
    # train.py's model and windows: the base is exactly what its --model_name_or_path loads. Imported here so that
    # writing the texts alone needs neither torch nor transformers.
    import torch
    from train import WINDOW, new_model

    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other, and on a busy machine far longer
    rng = random.Random(seed)
    data = "\n".join(word_salad(rng) for _ in range(4000)).encode()
    tokens = torch.tensor(list(data), dtype=torch.long)
    windows = tokens[:len(tokens) // WINDOW * WINDOW].view(-1, WINDOW)
    model = new_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(PRETRAIN_STEPS):
        batch = windows[torch.randint(len(windows), (16,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    print(f"base model: {PRETRAIN_STEPS} steps on word salad, loss {loss.item():.3f}, saved to {out}")


def write(out: Path) -> None:
    write_texts(out / "texts", files=2, lines=300, seed=0)
    write_texts(out / "heldout", files=1, lines=100, seed=1)
    write_base_model(out / "base")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
