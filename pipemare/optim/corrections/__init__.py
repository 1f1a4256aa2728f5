"""Staleness corrections, one module each beside its formula and citation.

=========================  =======================================  ==============================
correction                 what it changes                          source
=========================  =======================================  ==============================
``lr_reschedule`` (T1)     a stage's LR, ``1/τ`` relaxed over K     Yang et al., PipeMare, 2021
``discrepancy_correction`` backward weights ``w - Δδ``              Yang et al., PipeMare, 2021
(T2)
``weight_prediction``      forward weights ``w + sδ``, in place     SpecTrain 2018, XPipe 2019,
                                                                    PipeOptim 2023
``spike_compensation``     update ``a·v + b·g`` for late gradients  Kosson et al., 2020
``delay_momentum``         a stage's momentum, rising with its      Ajanthan et al., ICML 2025
                           delay (Nesterov method, no stash)        (Nesterov method)
``stability_guard``        halves a stage's rate and corrections    the delayed-quadratic bound
                           while its gradient norm runs away        (this project)
``local_accumulation``     a stage sums ``ceil(τ/c)`` minibatches'   Elam et al. (PACI), 2026
                           gradients per update
``error_feedback``         adds ``c(d_t - d_{t-1})`` after a        Zmushko et al., 2026
                           delayed stage's update ``d_t``
=========================  =======================================  ==============================

T3 (synchronous warm-up) is a schedule switch: ``PipeMareConfig.warmup_steps``.
"""

from pipemare.optim.corrections.accumulation import LocalAccumulation, accumulation_steps
from pipemare.optim.corrections.base import Correction, StageView, StepAverage
from pipemare.optim.corrections.discrepancy import (
    DiscrepancyCorrection,
    backward_weight,
    velocity_decay,
    velocity_update,
)
from pipemare.optim.corrections.error_feedback import ErrorFeedback
from pipemare.optim.corrections.guard import StabilityGuard
from pipemare.optim.corrections.lr_reschedule import LRReschedule, lr_factor
from pipemare.optim.corrections.momentum import DelayMomentum, delay_momenta
from pipemare.optim.corrections.prediction import WeightPrediction, predicted_weight
from pipemare.optim.corrections.spike import SpikeCompensation, spike_coefficients

__all__ = [
    "Correction",
    "DelayMomentum",
    "DiscrepancyCorrection",
    "ErrorFeedback",
    "LRReschedule",
    "LocalAccumulation",
    "SpikeCompensation",
    "StabilityGuard",
    "StageView",
    "StepAverage",
    "WeightPrediction",
    "accumulation_steps",
    "backward_weight",
    "delay_momenta",
    "lr_factor",
    "predicted_weight",
    "spike_coefficients",
    "velocity_decay",
    "velocity_update",
]
