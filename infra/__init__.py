"""Plain-Python core of trainpipe: specs, storage, providers, runners and the node agent (no Prefect here)."""
