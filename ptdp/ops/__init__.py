"""Plain-torch kernels the models are built from, below every other layer of the package.

``weight_grad``: the linear and bias ops whose weight gradients the zero-bubble schedules can defer to a
W pass; ``norms``: LayerNorm/RMSNorm with the same property; ``fused``: bias+GeLU and bias+dropout+add,
compiled with ``--compile``. Nothing here knows processes, groups or pipelines.
"""
