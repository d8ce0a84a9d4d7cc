"""Sequence parallelism: ``linear`` (the all-gather/reduce-scatter linear that keeps only s/t tokens for backward) and ``grads`` (the TP sum of the sequence-split parameters' gradients)."""
