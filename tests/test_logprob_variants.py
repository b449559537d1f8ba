"""benchmarks/logprob_variants.py times other ways to compute the LM head's log-probs and entropy: they must compute
the scripts' numbers (values and gradients), or their timings say nothing."""

import importlib.util

from grpo_cli import ROOT


def test_every_variant_computes_what_the_scripts_compute():
    spec = importlib.util.spec_from_file_location("logprob_variants", ROOT / "benchmarks" / "logprob_variants.py")
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    variants.check()  # raises on the first value or gradient that differs
