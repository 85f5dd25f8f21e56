"""Protocols written as roles exchanging envelopes, independent of Flower's app layer."""
