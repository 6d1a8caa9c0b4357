"""The transformers releases hf-wide follows, checked when it is imported.

transformers 5.24 renamed the cache argument of its attention and decoder layers (``past_key_values`` became
``cache``). hf-wide's fused attention blocks take the layers' place and still read ``past_key_values``: under 5.24 a
wide model would decode without its cache, every token after the first wrong, with no error. Until the blocks follow
the rename, a newer transformers is refused at import rather than let a wide model give wrong numbers.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

TRANSFORMERS_BELOW = (5, 24)  # the first release hf-wide does not follow yet


def require_supported_transformers(version: str | None = None) -> None:
    """Raise ImportError if ``version`` (the installed transformers by default) is one hf-wide does not follow."""
    version = version or transformers.__version__
    if Version(version).release[:2] >= TRANSFORMERS_BELOW:
        below = ".".join(map(str, TRANSFORMERS_BELOW))
        raise ImportError(
            f"hf-wide supports transformers 5.x below {below}; {version} is installed. transformers {below} renamed "
            "the cache argument of its attention layers (past_key_values -> cache), which hf-wide's fused attention "
            "blocks do not take yet: a wide model would decode without its cache and give wrong tokens. Install a "
            f"supported release: pip install 'transformers>=5,<{below}'")
