"""Other frameworks' trainers on mlxdist (`mlxdist.lightning`, `mlxdist.hf` are their public
names); each uses only `mlxdist.torch`'s public API. No library package imports them."""
