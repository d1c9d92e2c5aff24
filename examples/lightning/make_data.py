"""Write the example's Parquet dataset (python make_data.py OUT_DIR): y = x·w + noise, in a few files."""

import sys
from pathlib import Path

import numpy as np
import pandas as pd

WEIGHTS = np.array([1.5, -2.0, 0.5, 3.0])


def write(out: Path, files: int = 3, rows: int = 500, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        x = rng.uniform(-1, 1, size=(rows, len(WEIGHTS)))
        frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(len(WEIGHTS))])
        frame["y"] = x @ WEIGHTS + rng.normal(0, 0.05, rows)
        frame.to_parquet(out / f"part-{index}.parquet", index=False)


if __name__ == "__main__":
    write(Path(sys.argv[1]))
