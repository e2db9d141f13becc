"""Your loop on mlxdist: what `mlxdist.torch` and `mlxdist.mlx` share (the session: ranks,
shares, collectives, stop requests). The gradient sums are the trainer's own (`sync/`)."""
