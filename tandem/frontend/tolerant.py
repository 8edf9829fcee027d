"""The tolerant reader of the agent routes (`/v1/messages`, `/v1/responses`): what a client sends that
tandem does not use, but that does not change what the answer means, is accepted and logged once per
name rather than refused. Agent clients add fields and beta features every month; refusing them breaks
the client even when the refusal is well-formed. What would change the answer is still refused, by name
(the list is in docs/frontend.md)."""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

log = logging.getLogger(__name__)

S = TypeVar("S", bound=msgspec.Struct)


class Notice:
    """Log lines written once per key in a process: a client sends the same field with every request. The
    keys come from clients, so at most `limit` are kept; past that, one line says the rest are not logged."""

    def __init__(self, limit: int = 1000) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._limit = limit

    def once(self, key: str, what: str) -> None:
        if key in self._seen or len(self._seen) > self._limit:
            return
        with self._lock:
            if key in self._seen or len(self._seen) > self._limit:
                return
            self._seen.add(key)
            full = len(self._seen) > self._limit
        if full:
            log.warning("more than %d kinds of ignored input: no more are logged", self._limit)
            return
        log.warning("%s: %s (logged once)", key, what)


notice = Notice()
WARNING_HEADER = "x-tandem-warning"


MAX_WARNING = 512


def left_out_header(tools: Sequence[str]) -> dict[str, str]:
    """The warning header of an answer whose request had tools the model was not offered. The names are the
    client's: anything but printable ASCII becomes `?` (a header cannot hold it, and a line break would start
    a header of the client's making), and a long list is cut."""
    names = "".join(c if " " <= c <= "~" else "?" for c in ", ".join(tools))
    if len(names) > MAX_WARNING:
        names = names[:MAX_WARNING] + "..."
    return {WARNING_HEADER: f"tools left out (tandem does not run them): {names}"}


_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])


class TolerantDecoder(Generic[S]):
    """Decodes a body into `struct`, whose undeclared top-level fields are ignored; each one's name is
    logged once. A strict decoder runs first, so a body with only declared fields costs one decode; the
    names are looked for only when the strict one finds an unknown field."""

    def __init__(self, struct: type[S], route: str) -> None:
        strict = types.new_class(f"Strict{struct.__name__}", (struct,), {"forbid_unknown_fields": True})
        self._strict: msgspec.json.Decoder[Any] = msgspec.json.Decoder(strict)
        self.lenient: msgspec.json.Decoder[S] = msgspec.json.Decoder(struct)
        self._known = frozenset(struct.__struct_encode_fields__)
        self._route = route

    def decode(self, body: bytes) -> S | None:
        """The struct, or None when the strict decoder refused the body (then decode it with `lenient` and
        the route's own error handling, which names what is wrong)."""
        try:
            return self._strict.decode(body)  # type: ignore[no-any-return]
        except msgspec.ValidationError as e:
            if "unknown field" not in str(e):
                return None
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return None
        try:
            names = _keys.decode(body).keys() - self._known
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # the lenient decode says what is wrong
            return None
        for name in names:
            notice.once(f"{self._route} field {name!r}", "accepted and ignored")
        return None
