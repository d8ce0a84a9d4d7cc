"""What each pipeline rank runs and which layers each stage holds: pure arithmetic, no torch.

The schedule registry (``registry``: each schedule's builder, placement, constraints, help, bubble and
memory), the action lists (``actions``, ``builders``), the NCCL-safe communication placement
(``communication``, walked by ``progress.drain``), the vocabulary-parallel passes (``vocab``) and Megatron's
layer layouts (``layout``). It sits below ``ptdp.config`` (whose choices, defaults and checks read it) and
imports nothing else of ptdp; the executor that runs the lists on process groups is ``ptdp.parallel.pipeline``.
"""
