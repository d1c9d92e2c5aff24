"""The run's picture: loss curve and where the time went, as a PNG small enough to embed in a markdown artifact."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on servers and workers; must precede pyplot
import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def run_chart_png(curve: Sequence[tuple[int, float]], phases: Mapping[str, float],
                  loss_floor: float | None) -> bytes:
    figure, (loss_axes, time_axes) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    try:
        if curve:
            loss_axes.plot([step for step, _ in curve], [loss for _, loss in curve], color="tab:blue", label="loss")
        if loss_floor is not None:
            loss_axes.axhline(loss_floor, color="tab:gray", linestyle="--", label=f"floor {loss_floor:.3f}")
        loss_axes.set(title="training loss", xlabel="step", ylabel="nats/token")
        if curve or loss_floor is not None:  # a run that failed before training has nothing to label
            loss_axes.legend(loc="upper right")
        names = list(phases)
        time_axes.barh(names, [phases[name] for name in names], color="tab:orange")
        time_axes.invert_yaxis()
        time_axes.set(title="time per phase", xlabel="seconds")
        return figure_png(figure)
    finally:
        plt.close(figure)


def figure_png(figure: Figure) -> bytes:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
