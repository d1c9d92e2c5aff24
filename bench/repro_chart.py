"""The repro benchmark's picture: where each configuration's job time went, and the predictor's estimate beside it."""

from __future__ import annotations

import textwrap

from bench.repro import ReproReport
from infra.analysis.charts import figure_png, plt

TERM_COLOURS = {"T_compute": "tab:blue", "T_network": "tab:orange", "T_io": "tab:green", "staging": "tab:gray"}


def repro_chart_png(report: ReproReport) -> bytes:
    """Stacked bars per configuration (T_compute, T_network, T_io of the steps, plus staging), a marker at the
    predicted job time, and the measured speedup vs (a) over each bar."""
    figure, axes = plt.subplots(figsize=(8, 4.2), dpi=90)
    try:
        labels = [f"({r.key}) " + textwrap.fill(r.title, 24) for r in report.results]
        bottoms = [0.0] * len(report.results)
        for term, colour in TERM_COLOURS.items():
            heights = [r.stage_s if term == "staging" else r.terms_s[term] for r in report.results]
            axes.bar(labels, heights, bottom=bottoms, color=colour, label=term)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        predicted = [(label, r.predicted_job_s) for label, r in zip(labels, report.results, strict=True)
                     if r.predicted_job_s is not None]
        if predicted:
            axes.scatter([label for label, _ in predicted], [seconds for _, seconds in predicted], marker="D",
                         color="black", zorder=3, label="predicted from (a)")
        for label, top, result in zip(labels, bottoms, report.results, strict=True):
            if result.speedup is not None:
                axes.annotate(f"{result.speedup:.1f}×", (label, top), ha="center", va="bottom",
                              textcoords="offset points", xytext=(0, 3))
        tallest = max([*bottoms, *(seconds for _, seconds in predicted)])
        # Room above the tallest bar for its speedup label.
        axes.set(title="job time per configuration (staging + training steps)", ylabel="seconds",
                 ylim=(0, tallest * 1.15))
        axes.legend(loc="upper right", fontsize="small")
        return figure_png(figure)
    finally:
        plt.close(figure)
