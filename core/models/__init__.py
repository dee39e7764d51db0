"""Model architectures, one file per family on the shared decoder in `base`, whose layers run the
blocks in `blocks`. Weights come from `candelabra.core.loading` (`load_model`)."""

from __future__ import annotations

from candelabra.core.models.base import DecoderModel

__all__ = ["DecoderModel"]
