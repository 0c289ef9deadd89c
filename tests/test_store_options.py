"""The stores' own options mirror the Settings fields they stand for."""

from __future__ import annotations

from dataclasses import fields

import pytest

from service.settings import Settings
from service.store import StoreOptions

pytestmark = pytest.mark.unit


def test_store_options_have_the_settings_names_and_defaults() -> None:
    """Declared once: each Settings field of a store option takes StoreOptions' default."""
    declared = Settings.model_fields
    for f in fields(StoreOptions):
        assert declared[f.name].default == getattr(StoreOptions(), f.name), f.name


def test_store_options_are_built_from_settings() -> None:
    s = Settings(redis_url="redis://127.0.0.1:1/0", namespace="blue", max_brokers=7)
    o = StoreOptions.of(s)
    assert (o.redis_url, o.namespace, o.max_brokers) == ("redis://127.0.0.1:1/0", "blue", 7)
    assert StoreOptions.of(o) is o
