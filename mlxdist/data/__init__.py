"""Data: sources of token windows, the global sampler, and the background prefetcher.

Everything here hands out numpy int32 arrays; engines convert them to their own tensors.
"""

from .datasets import Dataset, build_datasets
from .prefetch import Prefetcher
from .sampler import GlobalSampler, rank_slice
from .tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Dataset", "GlobalSampler", "Prefetcher", "build_datasets", "rank_slice"]
