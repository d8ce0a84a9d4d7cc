"""Context parallelism: the sequence of each sample split over c ranks; ``apply`` swaps the attention and positions, ``attention`` holds ring, all-to-all and all-gather attention."""
