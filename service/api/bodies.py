"""Bodies a route reads itself (``PUT``/``PATCH /config``): validated as FastAPI's would be.

A route takes the raw request when the model it validates against is not the one it
declares (a whole config for PUT, a merge patch for PATCH): the errors are located under
``body`` as FastAPI's, and ``request_body`` declares the JSON body in openapi.yaml.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

M = TypeVar("M", bound=BaseModel)


async def parse(request: Request, adapter: TypeAdapter[M]) -> M:
    """The request body as a model (raises RequestValidationError, located under ``body``)."""
    return validated(adapter, await request.body())


def validated(adapter: TypeAdapter[M], body: bytes) -> M:
    """``parse`` on bytes in hand."""
    try:
        return adapter.validate_json(body or b"null")
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        ) from None


def request_body(
    model: type[BaseModel], media_types: tuple[str, ...] = ("application/json",)
) -> dict[str, Any]:
    """`openapi_extra` declaring a JSON body of ``model`` for a route that reads raw bytes.

    The schema is written out in place: FastAPI puts in the document's components only the
    models its routes declare, and a ``$ref`` to this one named nothing there."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    assert "$defs" not in schema, f"{model.__name__}: nested models need components"
    content = {media_type: {"schema": schema} for media_type in media_types}
    return {"requestBody": {"required": True, "content": content}}
