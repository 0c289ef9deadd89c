"""``python -m service.openapi``: print the app's OpenAPI document as YAML (openapi.yaml)."""

from __future__ import annotations

import sys
from typing import Any

import yaml

from service.app import create_app
from service.settings import Settings


def document() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def render(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)


if __name__ == "__main__":
    sys.stdout.write(render(document()))
