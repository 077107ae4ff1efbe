"""The validator: the held-out loss every validation.every steps, with fixed noise."""

from __future__ import annotations

import torch

from mdc import registry
from mdc.config import ObjectiveConfig, ValidationConfig
from mdc.data.images import normalize
from mdc.registry import compute_loss
from pipelines.data.seeds import validation_generator


def validation_objective(objective: ObjectiveConfig) -> ObjectiveConfig:
    """One yardstick across a sweep, the registry's `validation` of the objective: for every masking
    objective (whatever its training schedule or ratio) the masked-diffusion ELBO over t ∈ [T_MIN, 1]
    per non-pad token, estimated without bias (mdc/objectives/masked.py); exact NLL for AR ones; the
    baselines outside the family (clip, cdlm) are validated on their own loss."""
    validation = registry.objective(objective.name).validation
    return objective if validation is None else validation


class Validator:
    """Mean loss on `batches` (a list, empty: no validation) at its steps; comparable over time."""

    def __init__(
        self,
        config: ValidationConfig,
        batches: list[dict],
        objective: ObjectiveConfig,
        *,
        steps: int,
        seed: int,
        device,
    ):
        self.config, self.batches, self.objective = config, batches, validation_objective(objective)
        self.steps, self.seed, self.device = steps, seed, device

    def due(self, step: int) -> bool:
        return bool(self.batches) and (step % self.config.every == 0 or step == self.steps)

    @torch.no_grad()
    def loss(self, model) -> float:
        """Summed on the device: one host sync for the whole pass."""
        model.eval()
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.batches):
            gen = validation_generator(self.seed, i, self.device)
            images = normalize(batch["image"].to(self.device, non_blocking=True))
            loss, _ = compute_loss(
                model, images, batch["tokens"].to(self.device, non_blocking=True), self.objective, gen
            )
            total += loss.detach().float()
        model.train()
        return float(total) / len(self.batches)
