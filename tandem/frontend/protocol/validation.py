"""Reading a request body: msgspec decodes it straight into the route's typed Struct (its errors carry the
JSON path, which becomes the error's `param`), and each API's rule table bounds its fields. A `Rule` is
written once and read twice: by the range check here and by the OpenAPI description (`schema()`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from tandem.frontend.protocol.errors import fail, from_validation

U32 = 2**32
MAX_TOKENS_LIMIT = U32  # engines count tokens in 32 bits
MAX_STOP = 16
MAX_LOGPROBS = 20
I64_MAX = 2**63 - 1  # the largest count the request plane carries signed

_any_decoder = msgspec.json.Decoder()


class Rule(msgspec.Struct, frozen=True):
    """The values one numeric field may take: [minimum, maximum] (the minimum excluded when
    `exclusive_minimum`), or `also`, one value outside the range with a meaning of its own (top_k's -1)."""

    field: str
    kind: Literal["integer", "number"]
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    also: int | None = None
    message: str | None = None  # what the error says instead of the range (the value follows)

    def allows(self, value: float) -> bool:
        if value == self.also:
            return True
        low, high = self.minimum, self.maximum
        if low is not None and (value <= low if self.exclusive_minimum else value < low):
            return False
        return high is None or value <= high

    def explain(self, name: str, value: Any) -> str:
        if self.message is not None:
            return f"{name} {self.message} (got {value})"
        low, high = _plain(self.minimum), _plain(self.maximum)
        if high is not None and high >= I64_MAX and value > high:
            what = f"at most {high}"
        elif high is None or high >= I64_MAX:  # a bound of the wire, not of the field: not worth naming
            what = f"greater than {low}" if self.exclusive_minimum else f"at least {low}"
        else:
            what = f"in ({low}, {high}]" if self.exclusive_minimum else f"between {low} and {high}"
        return f"{name} must be {what} (got {value})"

    def schema(self, *, nullable: bool = True) -> dict[str, Any]:
        """The field's JSON schema (null allowed unless the field is required)."""
        bounds: dict[str, Any] = {"type": self.kind}
        if self.minimum is not None:
            bounds["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = _plain(self.minimum)
        if self.maximum is not None:
            bounds["maximum"] = _plain(self.maximum)
        if self.minimum == self.maximum:
            bounds = {"const": _plain(self.minimum)}
        if self.also is not None:
            bounds = {"anyOf": [{"const": self.also}, bounds]}
        return {"anyOf": [bounds, {"type": "null"}]} if nullable else bounds


def _plain(x: float | None) -> Any:
    """2.0 as 2 in messages and schemas."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def check_rules(raw: Any, rules: Sequence[Rule], prefix: str = "") -> None:
    """A 400 naming the first field of `raw` out of its rule; `prefix`: where `raw`'s fields sit in the body
    (`sampling_params.`), for the errors' names."""
    for rule in rules:
        value = getattr(raw, rule.field)
        if value is not None and not rule.allows(value):
            raise fail(prefix + rule.field, rule.explain(prefix + rule.field, value))


def schemas(rules: Sequence[Rule]) -> dict[str, Any]:
    """The rules' fields as the properties of an OpenAPI object schema."""
    return {rule.field: rule.schema() for rule in rules}


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:  # a subclass of DecodeError, so first
        if "got `float`" not in str(e):
            raise from_validation(e) from None
        first = e
    except msgspec.DecodeError as e:
        raise fail(None, f"The request body is not valid JSON: {e}.") from None
    except UnicodeDecodeError:  # raised by msgspec for invalid UTF-8 inside a JSON string
        raise fail(None, "The request body is not valid UTF-8.") from None
    except RecursionError:
        raise fail(None, "The request body is nested too deeply.") from None
    # 8.0 is an integer to JSON Schema (and to OpenAI and vLLM): read integral floats as ints and retry.
    plain = decode_body(_any_decoder, body)  # the same answers for invalid JSON, UTF-8 or nesting
    try:
        return msgspec.convert(_integral_floats_as_ints(plain), decoder.type)
    except msgspec.ValidationError as again:
        raise from_validation(again) from None
    except RecursionError:
        raise from_validation(first) from None


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def check_wire(value: Any, param: str) -> Any:
    """`value` (free-form JSON the workers get: a schema, nvext's extras) as it is; a 400 naming `param`
    when it holds an integer the request plane cannot carry (msgpack's are at most 64 bits)."""
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        raise fail(param, f"'{param}' holds an integer beyond 64 bits, which cannot be sent to a worker.") from None
    return value


def check_wire_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A whole body the workers get as it is (a text-input model's request); a 400 naming its field that
    holds an integer beyond 64 bits."""
    try:
        msgspec.msgpack.encode(body)
    except OverflowError:
        for name, value in body.items():
            check_wire(value, name)
    return body
