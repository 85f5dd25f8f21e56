"""fedfm's server side on Flower (installed as ``fedfm_strategies``).

ServerApps and strategies that adapt the protocol roles in ``fedfm`` to Flower messages. The
double-blind adaptation ServerApp arrives with the protocol (issue 3); this package is empty until
then.
"""
