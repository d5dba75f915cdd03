"""Quantisation for QFedPolyp: fake quantisation for local training (``fake_quant``), the b-bit packed
payload codec (``codec``), and the INT8 deployment model (``int8``)."""
