"""The research harness: benchmarks, the paper's tables, sweeps, attacks and baselines.

Everything here measures or attacks the library; nothing in the library imports it (a test in
``tests/test_packaging.py`` checks this). Results go to ``results/`` through
:mod:`fedfm.experiments.results`; the commands are ``fedfm bench*``, ``fedfm paper``,
``fedfm sweep`` and ``fedfm baseline``.
"""
