"""The responses a frontend process has answered, kept for `previous_response_id` and
`GET /v1/responses/{id}`: a bounded LRU in the process's memory. A response id names the process that
made it, so an id from another process (another `--num-processes` replica, another frontend) is told
apart from one that was evicted or never existed."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tandem.frontend.requests import ImagePart

ID_PREFIX = "resp_"
_INSTANCE_HEX = 16  # the frontend's instance id, zero-padded, after the prefix


@dataclass(frozen=True)
class StoredResponse:
    """A response object as answered, and the conversation it ends (its input, with what came before it
    through `previous_response_id`, then its output) as chat messages, without the instructions, and the
    images of the messages' image parts in order."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    images: list[ImagePart]


class ResponseStore:
    """At most `capacity` responses, the least recently used evicted first; 0 stores none."""

    def __init__(self, capacity: int, instance_id: int) -> None:
        self.capacity = capacity
        self.instance = f"{instance_id:0{_INSTANCE_HEX}x}"
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def new_id(self, request_id: str) -> str:
        return f"{ID_PREFIX}{self.instance}{request_id}"

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def why_missing(self, response_id: str) -> str:
        """Why `response_id` is not here, in the words a client can act on."""
        if not response_id.startswith(ID_PREFIX) or len(response_id) <= len(ID_PREFIX) + _INSTANCE_HEX:
            return f"no response has the id {response_id!r}: it is not one this server made"
        owner = response_id[len(ID_PREFIX):len(ID_PREFIX) + _INSTANCE_HEX]
        if owner != self.instance:
            return (f"response {response_id!r} was made by another frontend process (instance {owner.lstrip('0')}); "
                    "responses are kept only by the process that made them, so a conversation must reach the same "
                    "process (or send its whole history instead of previous_response_id)")
        if self.capacity <= 0:
            return "this frontend stores no responses (--responses-store-size 0)"
        return (f"response {response_id!r} is not stored here: it was made with store=false, deleted, or evicted "
                f"(this frontend keeps the last {self.capacity} responses, --responses-store-size)")
