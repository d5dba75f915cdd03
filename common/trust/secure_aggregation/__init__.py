"""Secure aggregation (SecAgg+, with the malicious-server checks of Bonawitz et al. 2017) for fedmed's strategies,
on Flower 1.42's own primitives (docs/secure-aggregation.md).

The protocol, with no transport, one module per part:

- :mod:`.settings`: the run config's ``[secure-aggregation]`` table; the share count and threshold of a round;
- :mod:`.vector`: the summed vector's :class:`Layout`, a contribution's encoding, the decoded sums, wire packing;
- :mod:`.masks`: every mask expanded from its whole secret (ChaCha20 keyed by HKDF of it; not Flower's 32-bit fold);
- :mod:`.messages`: the stages in order, the keys of their messages, the statements hospitals sign;
- :mod:`.hospital`: a hospital's answer to each stage and what it refuses (weak plans, unsigned keys, a survivor
  set others did not sign, both shares of one hospital, replayed rounds and models);
- :mod:`.server`: the server's state and stages, and an unmasking that finds and names a hostile share;
- :mod:`.methods`: what a method sums (``SecureMethod``, declared by each method's ``strategies/<method>/secure.py``
  and named in its ``MethodSpec``) and the FedAvg family's shared parts.

Its transports: ``strategies/secure_aggregation.py`` (the server's stages over a Flower ``Grid``) and
``client_app/secure_aggregation.py`` (the hospital's answers to them in a ClientApp). This package imports neither
Flower nor torch at import time, so ``common.config`` can hold the settings on machines without Flower.
"""

from .settings import SecureAggregationSettings, share_plan
from .vector import FLOAT, INTEGER, Entry, Layout, decode_sum, encode, modulus_bits, pack_values, unpack_values

__all__ = ["FLOAT", "INTEGER", "Entry", "Layout", "SecureAggregationSettings", "decode_sum", "encode", "modulus_bits",
           "pack_values", "share_plan", "unpack_values"]
