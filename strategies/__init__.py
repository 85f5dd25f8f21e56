"""fedfm's server side on Flower (installed as ``fedfm_strategies``).

ServerApps that adapt the protocol roles in ``fedfm`` to Flower: ``double_blind`` (the learning
service provider's role of double-blind adaptation), ``transport`` (fedfm's transport over a
Flower grid) and ``aggregation`` (aggregation through any Flower strategy).
"""
