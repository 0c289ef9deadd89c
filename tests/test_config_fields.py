"""Config is declared once (detour.model): every mapping derived from it carries every field.

Each test sets every field to a value other than its default (``NON_DEFAULT``, built from
the declaration), so a mapping that forgets a field, or a new field a mapping does not
derive, fails here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic.alias_generators import to_camel

from detour.client import wire
from detour.model import CONFIG_FIELDS, Config, ConfigField
from service.app import create_app
from service.schemas import ConfigBody
from service.settings import Settings
from service.store import codec
from tests.asgi_client import TestClient


def _other(f: ConfigField) -> Any:
    """A value the field's rules accept that is not its default."""
    if f.kind is bool:
        return not f.default
    if f.kind is str:
        return next(c for c in f.choices if c != f.default)
    if f.kind is tuple:
        assert f.ge is not None
        # Both tier lists get two increasing entries: the same length, as they must be.
        return (f.ge + 1, f.ge + 2)
    assert f.le is not None
    return f.default + 1 if f.default < f.le else f.default - 1


NON_DEFAULT = Config(**{f.name: _other(f) for f in CONFIG_FIELDS})
BODY = NON_DEFAULT.to_wire()


@pytest.mark.unit
def test_every_field_is_declared_with_a_non_default_value_here() -> None:
    assert [f.name for f in CONFIG_FIELDS] == list(Config.__dataclass_fields__)
    for f in CONFIG_FIELDS:
        assert getattr(NON_DEFAULT, f.name) != f.default, f.name
        assert f.description, f.name
    assert list(BODY) == [f.wire for f in CONFIG_FIELDS]


@pytest.mark.unit
def test_the_api_model_is_derived_field_by_field() -> None:
    fields = ConfigBody.model_fields
    # every field of Config, and the profile the config is (read only: detour/profiles.py)
    assert list(fields) == ["profile", *(f.name for f in CONFIG_FIELDS)]
    for f in CONFIG_FIELDS:
        # The same camelCase as every other body of the API.
        assert fields[f.name].alias == f.wire == to_camel(f.name)
        assert fields[f.name].description == f.description
    assert ConfigBody.model_validate(BODY).model_dump() == {"profile": None, **BODY}


@pytest.mark.unit
def test_redis_encoding_round_trips_every_field() -> None:
    raw = codec.encode_config(NON_DEFAULT)
    assert json.loads(raw) == BODY
    assert codec.decode_config(raw) == NON_DEFAULT
    # A config stored before a field existed reads as that field's default.
    assert codec.decode_config(json.dumps({"lastReportWins": True})) == Config(
        last_report_wins=True
    )


@pytest.mark.unit
def test_sdk_decodes_every_field() -> None:
    assert wire.config(BODY) == NON_DEFAULT
    # A pushed config carries its version and the store's clock beside it.
    assert wire.config({**BODY, "version": 7, "now": 1}) == NON_DEFAULT


@pytest.mark.unit
def test_sdk_takes_the_default_for_a_field_a_newer_service_widened() -> None:
    newer = {**BODY, "selection": "least-request", "isolationQuorum": 1000}
    with pytest.raises(ValueError):
        Config.from_wire(newer)
    got = wire.config(newer)
    assert got.selection == "round_robin" and got.isolation_quorum == 1
    assert got.max_avoided_percent == NON_DEFAULT.max_avoided_percent


@pytest.mark.unit
def test_report_script_policy_reads_config_fields_by_name() -> None:
    computed = {name: 1000 + i for i, name in enumerate(sorted(codec.REPORT_POLICY_COMPUTED))}
    assert codec.REPORT_POLICY_COMPUTED == {
        "keep_ms", "jitter_scale", "max_suspects", "max_isolations", "event_log_cap"
    }
    values = codec.encode_report_policy(NON_DEFAULT, computed).split(",")
    assert len(values) == len(codec.REPORT_POLICY)
    for name, value in zip(codec.REPORT_POLICY, values, strict=True):
        expected = computed[name] if name in computed else getattr(NON_DEFAULT, name)
        assert value == str(int(expected)), name
    with pytest.raises(ValueError):
        codec.encode_report_policy(NON_DEFAULT, {**computed, "extra": 1})


@pytest.mark.integration
def test_put_and_get_config_carry_every_field(settings: Settings) -> None:
    with TestClient(create_app(settings)) as c:
        put = c.put("/config", json=BODY)
        assert put.status_code == 200, put.text
        assert put.json() == {**BODY, "profile": None}  # a config of its own
        got = c.get("/config").json()
        assert got == {**BODY, "profile": None}
        assert wire.config(got) == NON_DEFAULT
    if settings.redis_url:
        # Another replica reads it back from Redis.
        with TestClient(create_app(settings)) as other:
            assert other.get("/config").json() == {**BODY, "profile": None}


def _outside(f: ConfigField) -> list[tuple[Any, str]]:
    """Values that break the field's own rules, with the field path the API must name."""
    if f.kind is bool:
        return [("yes", f.wire)]
    if f.kind is str:
        return [("nope", f.wire)]
    assert f.ge is not None and f.le is not None
    if f.kind is tuple:
        last = len(f.default) - 1
        return [
            ([*f.default[:-1], f.le + 1], f"{f.wire}[{last}]"),
            ([f.ge - 1, *f.default[1:]], f"{f.wire}[0]"),
            (list(range(f.max_items + 1)), f.wire),
        ]
    return [(f.le + 1, f.wire), (f.ge - 1, f.wire)]


@pytest.mark.integration
@pytest.mark.parametrize("f", CONFIG_FIELDS, ids=lambda f: f.wire)
def test_each_fields_rules_hold_in_the_api_and_the_model(f: ConfigField) -> None:
    with TestClient(create_app(Settings())) as c:
        for value, path in _outside(f):
            r = c.patch("/config", json={f.wire: value})
            assert r.status_code == 422, (value, r.text)
            assert r.json()["field"] == path
            # a whole config with the same value: the same refusal
            r = c.put("/config", json={**Config().to_wire(), f.wire: value})
            assert r.status_code == 422, (value, r.text)
            assert r.json()["field"] == path
            if f.kind is not bool:
                with pytest.raises(ValueError):
                    Config(**{f.name: tuple(value) if f.kind is tuple else value})
        assert c.get("/config").json() == {**Config().to_wire(), "profile": "rocketmq-4"}
