"""Gradient sync strategies and weight agreement across ranks. Knows arrays, not layers."""

from .grad import GradSync, SyncStats, checksum, plan_buckets

__all__ = ["GradSync", "SyncStats", "checksum", "plan_buckets"]
