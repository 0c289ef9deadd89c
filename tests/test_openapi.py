"""openapi.yaml is the published contract: it must be exactly what the app serves."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from service.app import create_app
from service.openapi import render
from service.settings import Settings
from tests.procs import ROOT

pytestmark = pytest.mark.unit


def served() -> dict[str, Any]:
    with TestClient(create_app(Settings())) as c:
        doc: dict[str, Any] = c.get("/openapi.json").json()
        return doc


def test_openapi_yaml_matches_the_app() -> None:
    published = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    assert published == served(), "openapi.yaml is stale: run `make openapi`"
    assert render(served()) == (ROOT / "openapi.yaml").read_text()


def test_every_field_has_a_description_and_an_example() -> None:
    doc = served()
    missing = [
        f"{name}.{field}: {key}"
        for name, schema in doc["components"]["schemas"].items()
        for field, prop in schema.get("properties", {}).items()
        for key in ("description", "examples")
        if key not in prop
    ]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for param in op.get("parameters", []):
                if "description" not in param or "examples" not in param["schema"]:
                    missing.append(f"{method} {path} {param['name']}")
    assert missing == []


def test_every_error_response_uses_the_error_schema() -> None:
    doc = served()
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")):
                    schema = resp["content"]["application/json"]["schema"]
                    assert schema == ref, f"{method} {path} {status}"
    assert "HTTPValidationError" not in doc["components"]["schemas"]
