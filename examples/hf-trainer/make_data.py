"""Write the example's JSONL texts (python make_data.py OUT_DIR): short sentences from a tiny grammar."""

import json
import random
import sys
from pathlib import Path

SUBJECTS = ("the cat", "a dog", "the model", "my friend", "the node")
VERBS = ("sees", "trains", "likes", "checkpoints", "stages")
OBJECTS = ("the data", "a bird", "the cluster", "its loss", "the bucket")


def write(out: Path, files: int = 2, lines: int = 300, seed: int = 0) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        with open(out / f"texts-{index}.jsonl", "w") as handle:
            for _ in range(lines):
                text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                handle.write(json.dumps({"text": text}) + "\n")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
