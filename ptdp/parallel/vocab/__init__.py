"""Vocabulary parallelism across pipeline stages (Yeung et al. 2024): the model transform and the S/T passes (``stage``)."""
