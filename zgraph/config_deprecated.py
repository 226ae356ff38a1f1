"""``Config``'s names from before pipeline parallelism, kept for one release: "pipeline" now means pipeline
parallelism, and the list of passes is ``Config.passes()``."""

from __future__ import annotations

import warnings
from typing import Any


class DeprecatedNames:
    """``Config.pipeline()`` and ``Config.pipeline_options()`` (removed in the next release)."""

    def pipeline(self) -> list:
        """Deprecated: ``passes()``."""
        warnings.warn("Config.pipeline() is deprecated: use Config.passes()", DeprecationWarning, stacklevel=2)
        return self.passes()  # type: ignore[attr-defined]  (Config's)

    def pipeline_options(self) -> dict[str, Any]:
        """Deprecated: ``pass_options()``."""
        warnings.warn(
            "Config.pipeline_options() is deprecated: use Config.pass_options()", DeprecationWarning, stacklevel=2
        )
        return self.pass_options()  # type: ignore[attr-defined]  (Config's)
