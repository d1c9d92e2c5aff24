"""The Data Docs page of a run's dataset validation: Great Expectations' own validation-results page, rendered from
the gate's results added up over every file, written next to the run's summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from infra.dataset import gx
from infra.dataset.gate import DatasetValidation, ExpectationResult

DOCS_NAME = "dataset-validation.html"


def _result(result: ExpectationResult) -> Any:
    from great_expectations.core.expectation_validation_result import ExpectationValidationResult
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    config = ExpectationConfiguration(**{k: v for k, v in result.config.items() if k in ("type", "kwargs", "meta")})
    percent = 100 * result.unexpected / result.rows if result.rows else 0.0
    summary = {"element_count": result.rows, "unexpected_count": result.unexpected, "unexpected_percent": percent,
               "unexpected_percent_nonmissing": percent, "missing_count": 0, "missing_percent": 0.0,
               "partial_unexpected_list": result.values}
    if result.observed is not None:
        summary = {"observed_value": result.observed}
    message = result.error or ""
    return ExpectationValidationResult(
        success=result.success, expectation_config=config, result=summary,
        meta={"files": result.files, "failed_files": result.failed_files},
        exception_info={"raised_exception": bool(result.error), "exception_message": message,
                        "exception_traceback": message})


def write_data_docs(validation: DatasetValidation, directory: Path, run_id: str) -> Path:
    """Render the page into directory/dataset-validation.html; returns its path."""
    gx.import_gx()
    import great_expectations
    from great_expectations.core.expectation_validation_result import ExpectationSuiteValidationResult
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    passed = sum(result.success for result in validation.results)
    count = len(validation.results)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    suite = ExpectationSuiteValidationResult(
        success=validation.ok, results=[_result(result) for result in validation.results],
        suite_name=f"dataset.expectations of run {run_id}",
        statistics={"evaluated_expectations": count, "successful_expectations": passed,
                    "unsuccessful_expectations": count - passed,
                    "success_percent": 100 * passed / count if count else 100.0},
        meta={"great_expectations_version": great_expectations.__version__,
              "batch_spec": {"dataset": validation.url, "validation": validation.mode,
                             "files": validation.files, "rows": validation.rows},
              "active_batch_definition": {"datasource_name": validation.url, "data_connector_name": "trainpipe",
                                          "data_asset_name": validation.url, "batch_identifiers": {}},
              "run_id": {"run_name": run_id, "run_time": stamp}, "validation_time": stamp})
    with gx.lock:
        html = DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(suite))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / DOCS_NAME
    temp = directory / f".{DOCS_NAME}.tmp"
    temp.write_text(html)
    temp.replace(path)
    return path
