"""openapi.yaml is the published contract: it must be exactly what the app serves."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from service.app import create_app
from service.openapi import render
from service.settings import Settings
from tests.asgi_client import TestClient
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


def test_every_schema_reference_names_a_schema_of_the_document() -> None:
    """A ``$ref`` to a model FastAPI never put in the components (the config bodies, read
    raw by their routes) left PUT and PATCH /config without a schema a client could use."""
    doc = served()

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return own + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    found = refs(doc)
    names = {f"#/components/schemas/{name}" for name in doc["components"]["schemas"]}
    assert found and set(found) <= names, sorted(set(found) - names)
    put = doc["paths"]["/config"]["put"]["requestBody"]["content"]["application/json"]
    assert "isolationQuorum" in put["schema"]["required"]


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


def test_every_body_route_documents_413() -> None:
    doc = served()
    body_routes = [(path, method) for path, ops in doc["paths"].items()
                   for method, op in ops.items() if "requestBody" in op]
    assert len(body_routes) >= 5
    for path, method in body_routes:
        assert "413" in doc["paths"][path][method]["responses"], f"{method} {path}"


def test_the_contract_states_the_config_lengths_and_distinct_brokers() -> None:
    """What the schema can state of the rules across fields, a JSON Schema validator holds:
    ``latencyMax`` and ``notAvailableDuration`` as long as each other (an omitted one is its
    default of seven), and no two identical brokers in a route."""
    import jsonschema

    doc = served()
    schemas = doc["components"]["schemas"]

    def validator(name: str) -> jsonschema.Draft202012Validator:
        # The document as the root, so that its "#/components/..." references resolve.
        return jsonschema.Draft202012Validator({**doc, "$ref": f"#/components/schemas/{name}"})

    config = validator("ConfigBody")
    assert config.is_valid({"latencyMax": [1, 2], "notAvailableDuration": [0, 5]})
    assert not config.is_valid({"latencyMax": [1, 2], "notAvailableDuration": [0]})
    assert not config.is_valid({"latencyMax": [1, 2]})  # the default windows are seven
    assert config.is_valid({"notAvailableDuration": [0, 0, 1, 2, 3, 4, 5]})
    assert config.is_valid({})
    route = validator("RouteBody")
    broker = {"brokerName": "broker-a", "writeQueueNums": 4}
    assert not route.is_valid({"brokers": [broker, broker]})
    assert schemas["RouteBody"]["properties"]["brokers"]["x-unique-item-properties"] == [
        "brokerName"]
