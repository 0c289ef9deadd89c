"""Deprecated: the producer SDK is ``detour.client`` (``pip install detour-client``).

Kept for one release so that producers written against 0.1.0 keep running; importing it
warns once (``DeprecationWarning``) and hands out the same classes.
"""

import warnings

from detour.client import *  # noqa: F403
from detour.client import __all__ as __all__

warnings.warn(
    "service.client is deprecated and will be removed in the next release: "
    "use `from detour.client import DetourClient` (the detour-client distribution)",
    DeprecationWarning,
    stacklevel=2,
)
