"""The typed config, for the drafter package's own modules: :class:`DrafterConfig` and :class:`Config` are declared
in :mod:`shared.config` (the bottom layer, so the verifier node needs nothing of this package); this re-export keeps
the drafter's many ``from drafter_node.settings import DrafterConfig`` lines short and stable.
"""

from __future__ import annotations

from shared.config import Config, DrafterConfig

__all__ = ["Config", "DrafterConfig"]
