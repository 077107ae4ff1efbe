"""What every objective's config is: a pydantic model of its own fields only (a field of another
objective is an error), one member of `RunConfig.objective`'s union, which mdc/config.py builds
from the torch-free table in mdc/objectives/sections.py."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict


class ObjectiveSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # MASKED_ELBO is one shared instance

    name: str
    # how the model uses the noise level t (model.time_conditioning): optional, required, never
    time: ClassVar[Literal["optional", "required", "never"]] = "optional"

    @property
    def null_image(self) -> bool:
        """Whether the model learns DDCap's null image (image-free training: masked objectives only)."""
        return False
