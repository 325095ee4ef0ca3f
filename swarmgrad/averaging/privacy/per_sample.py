"""Per-sample DP-SGD (``level="sample"``): clip each sample's gradient, sum, add noise, average.

Opacus's GradSampleModule computes the per-sample gradients; the clipping and noise are ours, as in release.py.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from .budget import Accounted, BudgetExhausted, PrivacyBudget
from .release import add_gaussian_noise, private_generator
from .settings import Privacy, PrivacyError


class PerSamplePrivacy(Accounted):
    """After ``loss.backward()`` on a batch, ``clip_and_noise_gradients()`` replaces every ``param.grad`` with the
    DP-SGD gradient: sum_i clip(g_i, clip_norm) + N(0, (noise_multiplier*clip_norm)^2), divided by batch_size."""

    def __init__(self, model: torch.nn.Module, privacy: Privacy, batch_size: int, dataset_size: int,
                 loss_reduction: Literal["mean", "sum"] = "mean", generator: torch.Generator | None = None) -> None:
        from opacus import GradSampleModule  # opacus takes ~1 s to import: only when privacy is on

        if privacy.level != "sample":
            raise PrivacyError("level: per-sample DP-SGD needs level='sample'; "
                               "with level='update' the averaging layer makes each release private")
        if batch_size < 1 or dataset_size < batch_size:
            raise PrivacyError(f"batch_size={batch_size} must be >= 1 and <= dataset_size={dataset_size}")
        sample_rate = batch_size / dataset_size
        if privacy.sample_rate is not None and abs(privacy.sample_rate - sample_rate) > 1e-12:
            raise PrivacyError(f"sample_rate={privacy.sample_rate} disagrees with batch_size/dataset_size="
                               f"{sample_rate:g}; leave sample_rate unset with level='sample'")
        # re-validate at the real sample rate so a target_epsilon is turned into noise for it
        self.privacy = Privacy.parse(**(privacy.model_dump() | {"sample_rate": sample_rate}))
        self.noise_multiplier = self.privacy.resolved_noise_multiplier()
        self.batch_size = batch_size
        # the first layer's inputs need no gradient, so torch warns that Opacus's hook fires on its
        # outputs: expected for per-sample gradients, and nothing a user can act on
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed",
                                category=UserWarning)
        try:  # hooks go on the model's own submodules: model(x) and self.module(x) both record per-sample grads
            self.module = GradSampleModule(model, loss_reduction=loss_reduction)
        except (NotImplementedError, ValueError) as error:
            raise PrivacyError(f"model: per-sample gradients are not available for it ({error})") from None
        self._params = [p for p in model.parameters() if p.requires_grad]
        # drawn where the gradients are: a GPU peer's noise never crosses to the device per step
        self._generator = generator if generator is not None else private_generator(self._params[0].device)
        self._budget = PrivacyBudget(self.noise_multiplier, sample_rate, self.privacy.delta,
                                     self.privacy.budget_limit(), self.privacy.accountant, what="step")
        self._last_sample_norms = torch.zeros(0)

    def clip_and_noise_gradients(self) -> None:
        """Turn the per-sample gradients of the last backward pass into the private ``param.grad``.

        Divides by the configured batch_size (the expected batch, as Opacus does), not by the batch's length, so a
        short batch cannot reveal its size through the gradient's scale. Raises BudgetExhausted (and clears the
        non-private gradients, so an optimizer step cannot apply them) when this step would pass max_epsilon.
        """
        samples = [_stacked(getattr(p, "grad_sample", None)) for p in self._params]
        present = [g for g in samples if g is not None]
        if not present:
            raise PrivacyError("no per-sample gradients: run a forward and backward pass on a batch first")
        try:
            self._budget.check()
        except BudgetExhausted:
            self._clear(grads=True)
            raise
        count = present[0].shape[0]
        per_param = torch.stack([g.reshape(count, -1).norm(2, dim=1) for g in present], dim=1)
        norms = per_param.norm(2, dim=1)  # whole-model gradient norm of each sample
        factors = (self.privacy.clip_norm / (norms + 1e-6)).clamp(max=1.0)
        std = self.noise_multiplier * self.privacy.clip_norm
        for param, grad_sample in zip(self._params, samples):
            if grad_sample is None:  # unused this batch: contributes nothing but still gets noise
                summed = torch.zeros_like(param, dtype=torch.float32)
            else:
                summed = torch.einsum("i,i...->...", factors.to(grad_sample.dtype), grad_sample).float()
            if std > 0:
                add_gaussian_noise(summed, std, self._generator)
            param.grad = (summed / self.batch_size).to(param.dtype)
        self._last_sample_norms = norms.detach()
        self._clear(grads=False)
        self._budget.commit()

    def _clear(self, grads: bool) -> None:
        # grad_sample would otherwise pile up across batches; raw grads must never outlive a refused step
        for param in self._params:
            param.grad_sample = None
            if grads:
                param.grad = None

    def last_sample_norms(self) -> torch.Tensor:
        """Each sample's gradient norm in the last step, before clipping."""
        return self._last_sample_norms

    @property
    def steps(self) -> int:
        """DP-SGD steps taken (each is one release)."""
        return self.releases


def _stacked(grad_sample: torch.Tensor | list[torch.Tensor] | None) -> torch.Tensor | None:
    # Opacus keeps a list when several backward passes ran before a step: their samples all count
    return torch.cat(grad_sample, dim=0) if isinstance(grad_sample, list) else grad_sample


def make_per_sample_private(model: torch.nn.Module, privacy: Privacy, batch_size: int, dataset_size: int,
                            loss_reduction: Literal["mean", "sum"] = "mean",
                            generator: torch.Generator | None = None) -> PerSamplePrivacy:
    """Per-sample DP-SGD for ``model``; accounting at sample_rate = batch_size / dataset_size per step."""
    return PerSamplePrivacy(model, privacy, batch_size, dataset_size, loss_reduction, generator)
