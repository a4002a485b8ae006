"""Shared test settings: hypothesis profiles sized for a 2-core CI machine, and Triton's
interpreter on machines without a GPU (set before any test imports triton, so that every
kernel of fp4lab.kernels runs interpreted on the CPU)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
