"""Agreed responses built directly, for tests that hand work to the negotiation cache, the
fusion plan or the dispatcher without negotiating it first."""

from __future__ import annotations

from typing import Any

from baguahvd.engine.messages import OpType, RequestMeta, Response


def agreed(key: str, op: OpType, process_set_id: int = 0, **fields: Any) -> Response:
    """The response for a collective named ``key``: the fields a request carries go into
    its ``meta`` (``name`` defaults to ``key``, ``rank`` to 0), the others (``first_dims``,
    ``splits``, ``error``, ``joined``, ``last_joined``) beside it."""
    own = {name: value for name, value in fields.items() if name in Response._fields}
    described = {name: value for name, value in fields.items() if name not in own}
    described.setdefault("name", key)
    described.setdefault("rank", 0)
    meta = RequestMeta(key=key, op=op, process_set_id=process_set_id, **described)
    return Response(meta, **own)


def redescribed(response: Response, **fields: Any) -> Response:
    """``response`` with some fields of its description (``meta``) changed."""
    return response._replace(meta=response.meta._replace(**fields))
