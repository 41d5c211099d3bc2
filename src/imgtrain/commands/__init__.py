"""Commands built on the whole library (``clean``, ``doctor``): they read runs, storage and the
cluster, so they sit above them and only ``cli.py`` imports them (tests/test_layers.py)."""
