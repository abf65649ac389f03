"""The chat template a server applies to ``messages`` (see :mod:`xspec.chat`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xspec.errors import RequestError


def chat_template_for(built: Any) -> Callable[[list[dict[str, Any]], dict[str, Any]], str]:
    def render(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        parts = []
        for m in messages:
            content = m.get("content")
            if not isinstance(content, str):
                raise RequestError("messages: content must be a string")
            parts.append(content)
        return "\n".join(parts) + "\n"

    return render
