"""How ranks agree: gradient all-reduce (`grad`, MLX) and DiLoCo's outer loop (`diloco`,
`outer_loop`, numpy only). Import the submodule you need: this package imports no framework."""
