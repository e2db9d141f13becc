"""Gradient sync strategies and weight agreement across ranks. Knows arrays, not layers."""

from ..engine.common import checksum
from .grad import GradSync, SyncStats, plan_buckets

__all__ = ["GradSync", "SyncStats", "checksum", "plan_buckets"]
