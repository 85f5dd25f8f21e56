"""fedfm's client side on Flower (installed as ``fedfm_clients``).

ClientApps that adapt the protocol roles in ``fedfm`` to Flower messages. The double-blind
adaptation ClientApp arrives with the protocol (issue 3); this package is empty until then.
"""
