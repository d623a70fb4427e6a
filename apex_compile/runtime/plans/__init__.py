"""The offload plans, one module each behind `Plan` (`base.py`); `make_plan` picks an engine's plan."""
from apex_compile.runtime.plans.base import Plan, make_plan
from apex_compile.runtime.plans.gpu_only import GpuOnlyPlan
from apex_compile.runtime.plans.overlap import OverlapPlan
from apex_compile.runtime.plans.staggered import StaggeredPlan

__all__ = ["GpuOnlyPlan", "OverlapPlan", "Plan", "StaggeredPlan", "make_plan"]
