"""fedfm's client side on Flower (installed as ``fedfm_clients``).

ClientApps that adapt the protocol roles in ``fedfm`` to Flower messages: ``double_blind`` (the
data owner's role of double-blind adaptation) and ``codec`` (fedfm envelopes as Flower messages,
shared with the server side).
"""
