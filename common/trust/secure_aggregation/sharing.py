"""Shamir's secret sharing of a round's two secrets per hospital (its mask seed, its first private key).

Textbook Shamir over the prime field of the Mersenne prime 2^521 - 1: a secret of up to 64 bytes is one field
element (behind a 0x01 byte, so its length survives); its shares are the values at x = 1..n of a polynomial whose
constant term is the secret and whose other threshold - 1 coefficients are drawn uniformly from the field with
``secrets``; any threshold of them rebuild it by Lagrange interpolation at 0, fewer say nothing of it.

Why not Flower's ``flwr.common.secure_aggregation.crypto.shamir``: it shares 16-byte chunks with PyCryptodome's
pure-Python GF(2^128) arithmetic, starting a thread pool for every secret, and Flower shares a private key as its
306-byte PEM text (20 chunks). At 20 hospitals that was 0.74 s of every round to share and 0.5 s to rebuild, more
than everything else the protocol does; here one field element per secret, and a private key is shared as its 32 raw
X25519 bytes (:mod:`.keys`). Shares keep Flower's layout: 4 bytes of index, then the value.
Nothing rests on the shares being checked here: every share's SHA-256 is committed to and checked by its holder and
the server, and every rebuilt secret against its owner's commitment or public key (:mod:`.hospital`, :mod:`.server`).
"""

from __future__ import annotations

import secrets

PRIME = 2**521 - 1  #: the field: a Mersenne prime, above every secret shared here
VALUE_BYTES = 66  #: a field element, big-endian
MAX_SECRET = 64  #: bytes: 0x01 + 64 bytes is 520 bits, below the prime


def create_shares(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` shares of ``secret`` (at most 64 bytes), any ``threshold`` of which rebuild it."""
    if not 1 <= threshold <= count or len(secret) > MAX_SECRET:
        raise ValueError(f"cannot share {len(secret)} bytes {threshold} of {count}")
    coefficients = [int.from_bytes(b"\x01" + secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = []
    for x in range(1, count + 1):
        value = 0
        for coefficient in reversed(coefficients):  # Horner
            value = (value * x + coefficient) % PRIME
        shares.append(x.to_bytes(4, "little") + value.to_bytes(VALUE_BYTES, "big"))
    return shares


def combine_shares(shares: list[bytes]) -> bytes:
    """The secret that ``shares`` (threshold of them, or more: all are used) rebuild; ValueError for shares that are
    malformed, repeat an index, or rebuild no secret."""
    if not shares or any(len(share) != 4 + VALUE_BYTES for share in shares):
        raise ValueError("the shares are not of one secret")
    points = [(int.from_bytes(share[:4], "little"), int.from_bytes(share[4:], "big")) for share in shares]
    xs = [x for x, _ in points]
    if len(set(xs)) != len(xs) or min(xs) < 1 or max(y for _, y in points) >= PRIME:
        raise ValueError("the shares are not of one secret")
    secret = 0
    for i, (x_i, y_i) in enumerate(points):  # Lagrange at 0: y_i x prod x_j / (x_j - x_i)
        numerator = denominator = 1
        for j, x_j in enumerate(xs):
            if j != i:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        secret = (secret + y_i * numerator * pow(denominator, -1, PRIME)) % PRIME
    data = secret.to_bytes(VALUE_BYTES, "big").lstrip(b"\x00")
    if not data or data[0] != 1 or len(data) > MAX_SECRET + 1:
        raise ValueError("Failed to combine shares")
    return data[1:]
