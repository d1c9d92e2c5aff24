"""Write the example's CSV dataset: y = x·w + noise, in a few files (python make_data.py OUT_DIR)."""

import csv
import random
import sys
from pathlib import Path

WEIGHTS = (1.5, -2.0, 0.5, 3.0)


def write(out: Path, files: int = 3, rows: int = 400, seed: int = 0) -> None:
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        with open(out / f"part-{index}.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow([f"x{i}" for i in range(len(WEIGHTS))] + ["y"])
            for _ in range(rows):
                xs = [rng.uniform(-1, 1) for _ in WEIGHTS]
                y = sum(a * b for a, b in zip(xs, WEIGHTS, strict=True)) + rng.gauss(0, 0.05)
                writer.writerow([f"{v:.5f}" for v in xs] + [f"{y:.5f}"])


if __name__ == "__main__":
    write(Path(sys.argv[1]))
