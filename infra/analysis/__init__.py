"""Analysis: where a run's step time went (breakdown), what it would take on other hardware (predict,
predict_report), whether a cluster delivers what it costs (clusterbench) and the run's pictures (charts, matplotlib).

May import: job, compute (offers, runners) and the node agent's measurement commands. The trainer imports
breakdown's keys only.
"""
