"""Gradient sync strategies and weight agreement across ranks. Knows arrays, not layers."""

from ..engine.common import checksum
from .diloco import DiLoCo, OuterOptimizer, OuterStats
from .grad import GradSync, SyncStats, plan_buckets

__all__ = ["DiLoCo", "GradSync", "OuterOptimizer", "OuterStats", "SyncStats", "checksum", "plan_buckets"]
