"""The ``ptdp`` command line: ``main`` parses and calls (one module per verb that is more than a call)."""
