"""The Responses API's `store`: finished responses kept in memory for `previous_response_id`.

Bounded by count and evicted oldest first (insertion order): the server must not grow
without end under a client that stores every response and never follows one up. A
follow-up of an evicted or unknown id is a 404 naming `previous_response_id`. Nothing
survives a restart (vLLM's store is in memory too).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# What a server keeps when started without --max-stored-responses.
DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True, slots=True)
class StoredResponse:
    # The conversation as chat messages: the request's input (after its own previous
    # responses) and then this response's output; instructions are not part of it.
    messages: list[dict[str, Any]]
    response: dict[str, Any]  # the response object as returned (GET /v1/responses/{id})


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if max_entries < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Stores `entry`, evicting the oldest entries past the bound (0 stores nothing)."""
        self._entries[response_id] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def __len__(self) -> int:
        return len(self._entries)
