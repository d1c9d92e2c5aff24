"""The bundled example workload: a small GPT trained with DDP, and the checkpoint, data and metrics helpers a user's
script can import. May import torch, and infra's checkpoints, dataset, workload, storage, node (sync state) and
analysis.breakdown (its keys); never Prefect, flows or tasks (tests/test_layering.py)."""
