"""Masks from the whole agreed secret: HKDF-SHA256 of the secret keys ChaCha20, whose key stream is the mask.

Flower's SecAgg+ expands a mask with ``secaggplus_utils.pseudo_rand_gen``, which XORs the secret's 4-byte words into
one 32-bit seed of NumPy's MT19937: whatever the key agreement gave, a mask then has at most 2^32 values, and a
server left with one mask to remove (a round of two hospitals, a hospital whose vector came after it was declared
dropped) finds it by trying every seed (about 2.6 core-hours, vectorised). Here every mask, private and pairwise,
depends on every byte of its secret (the 32 random bytes of a mask seed; the ECDH shared key): HKDF-SHA256 derives a
256-bit ChaCha20 key from it, and the cipher's key stream, read as little-endian words, gives the values.

Why a stream cipher, not a faster non-cryptographic generator keyed by the secret (PCG64, Philox): the server knows
some mask values outright wherever it knows what was masked (a FedMEPD hospital's zeros for the modalities it lacks,
a count it can guess), and those generators' state follows from a few of their outputs; ChaCha20's key does not.
Only ``cryptography`` (which Flower ships) is used: HKDF and ChaCha20 are its primitives, not ours.
"""

from __future__ import annotations

import numpy as np

MASK_INFO = b"fedmed secure-aggregation mask v1"  #: HKDF's info: these keys are for masks and nothing else
NONCE = bytes(16)  #: every secret is fresh per round (new key pairs, a new seed), so one key stream per key


def mask_key(secret: bytes, context: bytes = b"") -> bytes:
    """The ChaCha20 key of the mask expanded from ``secret`` (any length; every byte counts) for ``context``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("a mask secret is at least 16 bytes (128 bits)")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=MASK_INFO + context).derive(secret)


def expand_mask(secret: bytes, modulus: int, size: int, context: bytes = b"") -> np.ndarray:
    """``size`` values uniform in [0, ``modulus``) (a power of 2 up to 2^62) from ``secret``, as int64. A pairwise
    mask takes the round plan's SHA-256 as ``context``: two hospitals told different plans add masks that do not
    cancel, so a sum over hospitals that were shown different plans stays masked."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    if modulus < 2 or modulus & (modulus - 1) or modulus > 2**62:
        raise ValueError(f"modulus {modulus} is not a power of 2 up to 2^62")
    width = 4 if modulus <= 2**32 else 8
    words = np.empty(size + 16 // width, dtype=f"<u{width}")  # room for a block more, as update_into asks
    encryptor = Cipher(algorithms.ChaCha20(mask_key(secret, context), NONCE), mode=None).encryptor()
    encryptor.update_into(bytes(size * width), memoryview(words).cast("B"))
    words = words[:size]
    if modulus != 2 ** (8 * width):
        np.bitwise_and(words, modulus - 1, out=words)
    return words.astype(np.int64)
