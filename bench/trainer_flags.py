"""The bundled trainer's (trainer.train) model flags, written once for the benches that run it.

Kept apart from trainer.model so that a bench can build a command line without importing torch.
"""

from __future__ import annotations

# The synthetic Markov datasets the benches write use 256 tokens.
VOCAB_SIZE = 256


def model_flags(d_model: int, n_layers: int, n_heads: int, seq_len: int) -> list[str]:
    """`trainer.train`'s flags for a model of this shape on the benches' vocabulary."""
    return ["--vocab-size", str(VOCAB_SIZE), "--d-model", str(d_model), "--n-layers", str(n_layers),
            "--n-heads", str(n_heads), "--seq-len", str(seq_len)]
