"""The one error of datasets, apart from the token format's models (manifest.py) so that the node agent, which
raises it while staging, does not build those models on every start."""

from __future__ import annotations


class DatasetError(Exception):
    """A dataset that cannot be used; the message is one line naming the object and the fix."""
