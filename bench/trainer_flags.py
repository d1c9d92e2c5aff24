"""The bundled trainer's (trainer.train) model shape and its flags, written once for the benches that run it.

Kept apart from trainer.model so that a bench can build a command line without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# The synthetic Markov datasets the benches write use 256 tokens.
VOCAB_SIZE = 256


@dataclass(frozen=True)
class ModelShape:
    """The size of the bundled GPT a bench trains."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int = 64

    def flags(self) -> list[str]:
        """`trainer.train`'s flags for a model of this shape on the benches' vocabulary."""
        return ["--vocab-size", str(VOCAB_SIZE), "--d-model", str(self.d_model), "--n-layers", str(self.n_layers),
                "--n-heads", str(self.n_heads), "--seq-len", str(self.seq_len)]
