"""The pure core: OpenAI requests -> validated values -> OpenEngine legs. No I/O anywhere here.

- api: parse and validate request bodies (chat, completions) into ApiRequest
- media: image part rules, ordering and UUIDs
- engine: the context-window rule, media and feature gating, and the full engine leg
Failures are orchestrator.errors.InvalidRequest (a domain error; its HTTP status is the frontend's).
"""

from orchestrator.convert.api import ApiRequest, parse_chat, parse_completion
from orchestrator.convert.engine import (
    Limits,
    check_media_capability,
    check_media_options,
    check_media_sources,
    check_worker_features,
    check_worker_media,
    full_leg,
    resolve_limits,
    serves_features,
)
from orchestrator.convert.media import ImageRef, MediaLimits

__all__ = ["ApiRequest", "ImageRef", "Limits", "MediaLimits", "check_media_capability",
           "check_media_options", "check_media_sources", "check_worker_features",
           "check_worker_media", "full_leg", "parse_chat", "parse_completion", "resolve_limits",
           "serves_features"]
