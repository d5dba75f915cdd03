"""A hospital's name bound to its key: the identity reply is signed with the hospital's SuperNode key.

A SuperNode proves to the SuperLink that it holds a registered key (``flwr supernode register``), but the
ServerApp only sees node ids, and the hospital name in an identity reply is self-declared. So the server
sends a fresh nonce with every identity query; the hospital signs ``run name | nonce | name`` with the
private key it also gives ``flower-supernode --auth-supernode-private-key`` (node config ``identity-key``),
and the server verifies the signature with that hospital's registered public key (run config
``hospital-keys``: a folder of ``<hospital>.pub``, the files ``deploy/register_hospitals.sh`` registers).
A node that cannot sign for the name it claims is refused. Keys are ECDSA P-384 in OpenSSH format
(``deploy/make_hospital_keys.sh``).

**Signatures.** A secure round has every hospital check dozens of signatures (each neighbour's keys, every
survivor's signature of the survivor set), and a P-384 verification costs about 0.3 ms. So the identity key signs
once, per process, an Ed25519 key derived from it (HKDF-SHA256 of its private scalar: the same key at every restart,
nothing more to keep), and that Ed25519 key signs every statement. A signature is the Ed25519 public key (32 bytes),
its signature of the statement (64 bytes) and the identity key's ECDSA signature of ``fedmed-protocol-key-v1|`` and
that public key (the endorsement). A verifier checks an endorsement once per (registered key, Ed25519 key) and
process, then only Ed25519 signatures (about a quarter of P-384's cost). Whoever holds the identity key's private
half, and no one else, can make a signature that verifies.

**Pinned keys.** A registered key file says nothing of who put it there. ``statement_problem(..., pins=...)`` also
requires the key file's fingerprint to be the one a hospital's policy pins for that name (``peers``,
common/trust/policy.py). A fingerprint is OpenSSH's: ``SHA256:`` and the unpadded base64 of the SHA-256 of the public
key's OpenSSH wire encoding (the base64 field of the ``.pub`` line, decoded), what ``ssh-keygen -l -f KEY.pub`` and
``fedmed key-fingerprint KEY.pub`` print.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path
from typing import Mapping

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_ssh_private_key,
    load_ssh_public_key,
)

IDENTITY_QUERY = "hospital-info"  #: the query config value of the server's question which hospital a node is
NONCE_KEY = "identity-nonce"  #: query config: what the hospital signs
SIGNATURE_KEY = "signature"  #: identity reply: the signature, bytes
ENDORSEMENT_PREFIX = b"fedmed-protocol-key-v1|"  #: what the identity key signs, before the Ed25519 public key
PROTOCOL_KEY_INFO = b"fedmed protocol signing key v1"  #: HKDF info: the Ed25519 key from the identity key
ED25519_BYTES, ED25519_SIGNATURE_BYTES = 32, 64


def new_nonce() -> str:
    return secrets.token_hex(16)


def signed_text(run_name: str, nonce: str, name: str) -> bytes:
    return f"fedmed-identity|{run_name}|{nonce}|{name}".encode()


def sign_identity(private_key_file: str | Path, run_name: str, nonce: str, name: str) -> bytes:
    """The hospital's signature of its name for this query (ValueError naming the file if it is no key)."""
    return sign_statement(private_key_file, signed_text(run_name, nonce, name))


#: a key file as last read: path -> ((inode, size, modification time), the key); a key file replaced is read again
_KEYS: dict[tuple[Path, bool], tuple[tuple[int, int, int], object]] = {}
#: a registered key file as last read: its path -> ((inode, size, modification time), the key, its fingerprint)
_REGISTERED: dict[str, tuple[tuple[int, int, int], object, str]] = {}
#: id of an identity key object -> (the key, kept alive so that its id is not reused; its Ed25519 protocol key, that
#: key's public half, the identity key's endorsement of it, the identity key's fingerprint)
_SIGNERS: dict[int, tuple[object, tuple[Ed25519PrivateKey, bytes, bytes, str]]] = {}
#: (registered key's fingerprint, Ed25519 public key) pairs whose endorsement verified -> the Ed25519 key
_ENDORSED: dict[tuple[str, bytes], Ed25519PublicKey] = {}


def _read_key(path: Path, private: bool) -> object:
    """The key in ``path``, parsed once while the file stays the same (a secure round checks dozens of signatures
    against the same few files). OSError or ValueError as the loader raises them."""
    status = path.stat()
    identity = (status.st_ino, status.st_size, status.st_mtime_ns)
    known = _KEYS.get((path, private))
    if known is not None and known[0] == identity:
        return known[1]
    data = path.read_bytes()
    try:
        key = load_ssh_private_key(data, password=None) if private else load_ssh_public_key(data)
    except UnsupportedAlgorithm as error:  # not an OpenSSH key of a kind it reads (a private key as .pub, say)
        raise ValueError(str(error)) from None
    _KEYS[path, private] = (identity, key)
    return key


def _signer(private_key_file: str | Path) -> tuple[Ed25519PrivateKey, bytes, bytes, str]:
    """The identity key's Ed25519 protocol key (HKDF-SHA256 of its private scalar), that key's public half, the
    identity key's endorsement of it and the identity key's fingerprint: made once per version of the file
    (:func:`_read_key` keeps one key object per version). ValueError when it is no ECDSA private key."""
    key = _read_key(Path(private_key_file).absolute(), private=True)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("it is not an ECDSA key")
    known = _SIGNERS.get(id(key))
    if known is None:
        scalar = key.private_numbers().private_value.to_bytes((key.curve.key_size + 7) // 8, "big")
        seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=PROTOCOL_KEY_INFO).derive(scalar)
        protocol = Ed25519PrivateKey.from_private_bytes(seed)
        public = protocol.public_key().public_bytes_raw()
        endorsement = key.sign(ENDORSEMENT_PREFIX + public, ec.ECDSA(hashes.SHA384()))
        known = _SIGNERS[id(key)] = (key, (protocol, public, endorsement, key_fingerprint(key.public_key())))
    return known[1]


def sign_statement(private_key_file: str | Path, statement: bytes) -> bytes:
    """The hospital's signature of ``statement``: its Ed25519 protocol key's, with that key endorsed by its identity
    key (module docstring); ValueError naming the file when the identity key cannot be read or is no ECDSA key."""
    try:
        protocol, public, endorsement, _ = _signer(private_key_file)
    except (OSError, ValueError) as error:
        raise ValueError(f"node config key 'identity-key': cannot use {private_key_file} as the hospital's ECDSA "
                         f"private key ({error})") from None
    return public + protocol.sign(statement) + endorsement


def key_fingerprint(key: str | Path | ec.EllipticCurvePublicKey) -> str:
    """OpenSSH's SHA-256 fingerprint of a public key (a ``.pub`` file or a key): ``SHA256:`` and the unpadded
    base64 of the SHA-256 of its wire encoding, as ``ssh-keygen -l`` prints it."""
    if not isinstance(key, ec.EllipticCurvePublicKey):
        key = _read_key(Path(key).absolute(), private=False)
    blob = base64.b64decode(key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH).split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def own_fingerprint(private_key_file: str | Path) -> str:
    """The fingerprint of the public half of the identity key in ``private_key_file`` (a hospital pins its own key
    by holding it)."""
    try:
        return _signer(private_key_file)[3]
    except ValueError as error:
        raise ValueError(f"node config key 'identity-key': {private_key_file}: {error}") from None


def identity_problem(keys_folder: str | Path, run_name: str, nonce: str, name: str, signature: object) -> str | None:
    """Why the claim to be ``name`` is not proven (``None``: the signature verifies with ``<name>.pub``)."""
    if not isinstance(signature, bytes) or not signature:
        return f"it claims to be {name!r} but sent no signature (node config 'identity-key' unset?)"
    return statement_problem(keys_folder, name, signed_text(run_name, nonce, name), signature,
                             f"it claims to be {name!r} but its signature")


def statement_problem(keys_folder: str | Path, name: str, statement: bytes, signature: object,
                      claim: str = "", pins: Mapping[str, str] | None = None) -> str | None:
    """Why ``signature`` is not ``name``'s signature of ``statement`` with its registered key ``<name>.pub`` in
    ``keys_folder`` (``None``: it is); ``claim`` begins the sentence for a signature that does not verify. ``pins``
    (a hospital's policy's ``peers``: name -> fingerprint): the key file must also be the one pinned for ``name``,
    whatever folder holds it."""
    if not isinstance(signature, bytes) or not signature:
        return f"{name!r} sent no signature (node config 'identity-key' unset?)"
    key_file = os.path.join(keys_folder, f"{name}.pub")
    try:
        key, fingerprint = _registered_key(key_file)
    except (FileNotFoundError, IsADirectoryError):
        return f"no key is registered for {name!r} (expected {key_file})"
    except (OSError, ValueError) as error:
        return f"the registered key {key_file} cannot be read ({error})"
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return f"the registered key {key_file} is not an ECDSA key"
    if pins is not None and pins.get(name) != fingerprint:
        pinned = pins.get(name)
        return (f"the key {key_file} ({fingerprint}) is not the one this hospital's policy pins for {name!r} "
                f"({'peers: ' + pinned if pinned else 'no pin for that name in its peers'})")
    failed = f"{claim or f'the signature in the name of {name!r}'} does not verify with {key_file}"
    public, signed = signature[:ED25519_BYTES], signature[ED25519_BYTES:ED25519_BYTES + ED25519_SIGNATURE_BYTES]
    endorsement = signature[ED25519_BYTES + ED25519_SIGNATURE_BYTES:]
    if not endorsement:
        return failed
    protocol = _ENDORSED.get((fingerprint, public))
    if protocol is None:
        try:
            key.verify(endorsement, ENDORSEMENT_PREFIX + public, ec.ECDSA(hashes.SHA384()))
            protocol = Ed25519PublicKey.from_public_bytes(public)
        except (InvalidSignature, ValueError):
            return failed
        _ENDORSED[fingerprint, public] = protocol
    try:
        protocol.verify(signed, statement)
    except InvalidSignature:
        return failed
    return None


def _registered_key(path: str) -> tuple[object, str]:
    """The public key in ``path`` and its fingerprint, parsed once while the file stays the same (a secure round
    checks hundreds of signatures against the same few files). OSError or ValueError as :func:`_read_key`."""
    status = os.stat(path)
    identity = (status.st_ino, status.st_size, status.st_mtime_ns)
    known = _REGISTERED.get(path)
    if known is None or known[0] != identity:
        key = _read_key(Path(path).absolute(), private=False)
        known = _REGISTERED[path] = (identity, key,
                                     key_fingerprint(key) if isinstance(key, ec.EllipticCurvePublicKey) else "")
    return known[1], known[2]
