"""The recording gateway: an OpenAI-compatible HTTP server in front of the engines, recording
every call of a rollout's session token in / token out, and the engine fleet it routes to."""

from dew.gateway._fields import CHAT_FIELDS, COMPLETION_FIELDS
from dew.gateway._fleet import Fleet
from dew.gateway._record import GatewaySession
from dew.gateway._responses import RESPONSE_FIELDS
from dew.gateway._served import ServedGateway
from dew.gateway._server import Gateway

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "Fleet",
    "Gateway",
    "GatewaySession",
    "RESPONSE_FIELDS",
    "ServedGateway",
]
