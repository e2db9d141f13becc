"""A stand-in for the `evaluate` package, which run_clm.py imports at the top but uses only
with --do_eval (`evaluate.load("accuracy")` downloads a metric script). The tests train only;
a call here says so instead of reaching the network."""


def load(*args, **kwargs):
    raise RuntimeError("tests/public/hf_run_clm/stubs/evaluate.py: evaluate.load is not available offline; "
                       "run run_clm.py without --do_eval")
