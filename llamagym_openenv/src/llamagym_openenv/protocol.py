"""What a LlamaGym env says over OpenEnv: one text action, one text observation with
the legal actions in its metadata, and the bounds both sides hold a peer to.

The server (:mod:`llamagym_openenv.server`) sends, for every reset and step::

    {"observation": {"text": "Sum 15, dealer 10, usable ace no.", "metadata": {...}},
     "reward": -1.0, "done": true,
     "metadata": {"legal_actions": ["stick", "hit"], "terminated": true,
                  "truncated": false, "info": {...}, ...}}

``metadata`` (:data:`LEGAL_ACTIONS` and the other keys below) is plain JSON, so any
OpenEnv client reads it; the client here (:mod:`llamagym_openenv.client`) reads the
same keys from any OpenEnv server and checks every value it is sent.
"""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation
from pydantic import Field

#: Metadata keys of an observation.
LEGAL_ACTIONS = "legal_actions"  # the names of the actions allowed now (strings)
TERMINATED = "terminated"  # Gymnasium's terminated and truncated, apart
TRUNCATED = "truncated"
INFO = "info"  # the env's info: its JSON scalars (won, score, ...), strings cut
EPISODE_CONTEXT = "episode_context"  # what holds for the episode (at reset)
SYSTEM_PROMPT = "system_prompt"  # the served agent's system prompt (at reset)
AGENT = "agent"  # the served agent's name

#: Bounds of what one side accepts from the other (a peer's data, never trusted).
MAX_ACTION_CHARS = 1_000
MAX_TEXT_CHARS = 100_000
MAX_INFO_STRING_CHARS = 2_000
MAX_INFO_KEYS = 64
#: The largest WebSocket message the server reads from a client (a reset or a step).
MAX_REQUEST_BYTES = 64 * 1024


class TextAction(Action):
    """An action by name: one of the observation's ``legal_actions`` (a Discrete env's
    action may also be sent as its index, ``"1"``)."""

    action: str = Field(..., max_length=MAX_ACTION_CHARS, description="The action's name.")


class TextObservation(Observation):
    """What the agent's prompt says of the env now: the served agent's own text."""

    text: str = Field("", description="The observation as the agent's prompt shows it.")
