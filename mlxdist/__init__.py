"""mlxdist: one training job across several Apple Silicon Macs (MLX + MPI), or one CUDA/MPS/CPU box (PyTorch)."""

__version__ = "0.1.0"
