"""One Great Expectations context per process, shared by every check trainpipe runs with it.

Importing GE and building a context costs seconds, so both happen once, on first use; GE is not thread-safe, so
every run holds `lock`.
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from great_expectations.core.batch_definition import BatchDefinition
    from great_expectations.core.expectation_validation_result import ExpectationSuiteValidationResult
    from great_expectations.data_context import EphemeralDataContext
    from great_expectations.expectations import Expectation

lock = threading.RLock()


def import_gx() -> None:
    """Import Great Expectations with its import-time noise filtered (and nothing else)."""
    # GE logs hundreds of lines at INFO from its import on, which would bury the pipeline's own lines.
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        # GE imports the long-deprecated sre_constants module; nothing for us to act on.
        warnings.filterwarnings(
            "ignore", message="module 'sre_(constants|parse)' is deprecated", category=DeprecationWarning
        )
        import great_expectations  # noqa: F401


@functools.cache
def context() -> EphemeralDataContext:
    import_gx()
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    config = DataContextConfig(
        store_backend_defaults=InMemoryStoreBackendDefaults(),
        analytics_enabled=False,
        progress_bars=ProgressBarsConfig(globally=False, metric_calculations=False),
    )
    return gx.get_context(mode="ephemeral", project_config=config)


@functools.cache
def dataframe_batch(asset: str) -> BatchDefinition:
    """A batch definition that validates whatever DataFrame a run passes it."""
    sources = context().data_sources
    source = sources.get("trainpipe") if "trainpipe" in sources.all() else sources.add_pandas("trainpipe")
    return source.add_dataframe_asset(asset).add_batch_definition_whole_dataframe("all")


@contextmanager
def suite_of(batch: BatchDefinition, expectations: list[Expectation]) -> Iterator[Any]:
    """A validation definition of these expectations over the batch, removed again afterwards."""
    import great_expectations as gx

    name = f"trainpipe-{uuid.uuid4().hex}"
    with lock:
        ctx = context()
        suite = ctx.suites.add(gx.ExpectationSuite(name=name))
        for expectation in expectations:
            suite.add_expectation(expectation)
        definition = ctx.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        try:
            yield definition
        finally:
            ctx.validation_definitions.delete(name)
            ctx.suites.delete(name)


def run(definition: Any, frame: pd.DataFrame, result_format: dict[str, Any]) -> ExpectationSuiteValidationResult:
    with lock:
        return definition.run(batch_parameters={"dataframe": frame}, result_format=result_format)
