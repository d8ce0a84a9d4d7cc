"""``ptdp plan``: a first-principles performance and memory model of PTD-P layouts, and a search over them.

Modules: ``spec`` (what is planned), ``memory`` (bytes per GPU), ``perf`` (seconds per iteration),
``space`` (the valid layouts), ``estimate`` (one layout's verdict, why a layout loses), ``bound`` (the
branch and bound), ``search``, ``command`` (the CLI). See docs/planner.md.
"""

from ptdp.planner.command import add_plan_arguments, run_plan
from ptdp.planner.memory import activation_microbatches_in_flight, memory_per_gpu
from ptdp.planner.search import Estimate, SearchResult, evaluate, search
from ptdp.planner.spec import GPT3_175B, ClusterSpec, GPTSpec, ParallelConfig, TrainingSpec

__all__ = [
    "GPT3_175B",
    "ClusterSpec",
    "Estimate",
    "GPTSpec",
    "ParallelConfig",
    "SearchResult",
    "TrainingSpec",
    "activation_microbatches_in_flight",
    "add_plan_arguments",
    "evaluate",
    "memory_per_gpu",
    "run_plan",
    "search",
]
