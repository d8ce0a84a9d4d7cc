"""Megatron-LM checkpoints: ``ptdp import --format megatron`` and ``ptdp export --format megatron``.

- ``args``: Megatron-LM's run arguments to and from ptdp's model flags, and what is refused (no torch)
- ``names``: Megatron-Core's parameter names and layouts to and from ptdp's full tensors
- ``read``: the ``torch_dist`` and the older ``torch`` formats, read whole in one process
- ``optim``: the distributed optimizer's state (Adam's moments, its step count) per parameter, read from
  the per-parameter format or cut from the gradient buckets, the LR schedule it continues with, and the
  optimizer formats that are refused
- ``buckets``: Megatron's gradient-buffer layout (parameter order, padding, buckets) rebuilt from the args
  and the model's shapes (no torch)
- ``write``: a ``torch_dist`` save that Megatron-Core loads in any layout
- ``command``: the two commands, and their dispatch by ``--format``
"""
