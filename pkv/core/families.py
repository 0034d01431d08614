"""The one table of synthetic trace families (numpy- and torch-free: the config schema,
the Snakefile's wildcards and the report's row order read it at parse time).

Each row names its prompt-length rule (a key of pkv.core.traces.LENGTH_RULES) and that
rule's parameters; a family whose rule the generator does not know is refused when its
trace is built, never given another family's lengths. A new family is a row here (and,
for a new kind of distribution, a rule in pkv.core.traces).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Family:
    description: str
    lengths: str                          # the prompt-length rule: a key of pkv.core.traces.LENGTH_RULES
    params: dict = field(default_factory=dict)   # that rule's keyword arguments


FAMILIES: dict[str, Family] = {
    "bucketed": Family("prompts at the four bucket lengths 8K/16K/32K/64K", "cycle",
                       {"lengths": (8192, 16384, 32768, 65536)}),
    "homogeneous": Family("every prompt the same length", "constant", {"length": 32768}),
    "bimodal": Family("a mix of short and long prompts: one long (32K-64K) for every three short (1K-8K)",
                      "bimodal", {"long": (32768, 65536), "short": (1024, 8192), "every": 4}),
    "uniform": Family("prompt lengths uniform over [min_len, max_len]", "uniform"),
    "zipf": Family("Zipf-distributed prompt lengths (bounded Pareto on [min_len, max_len])", "pareto",
                   {"alpha": 1.1}),
}
