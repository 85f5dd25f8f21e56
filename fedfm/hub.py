"""One quick probe of the Hugging Face Hub, so that offline machines fail in seconds.

Without network, ``datasets`` and ``huggingface_hub`` retry with back-off for close to a minute
before giving up; a single short request tells the same thing at once.
"""

from __future__ import annotations

import httpx
from huggingface_hub import constants, get_session

HUB_TIMEOUT_S = 5.0


def hub_unreachable_reason() -> str | None:
    """``None`` if the Hub answers (or offline mode is on), else why it cannot be reached."""
    if constants.HF_HUB_OFFLINE:
        return None
    try:
        # The Hub's own session honours proxies and HF_ENDPOINT like the libraries do.
        get_session().head(constants.ENDPOINT, timeout=HUB_TIMEOUT_S)
    except httpx.TransportError as error:
        return f"the Hub at {constants.ENDPOINT} is unreachable ({error})"
    return None
