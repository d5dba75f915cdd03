"""A hospital's name bound to its key: the identity reply is signed with the hospital's SuperNode key.

A SuperNode proves to the SuperLink that it holds a registered key (``flwr supernode register``), but the
ServerApp only sees node ids, and the hospital name in an identity reply is self-declared. So the server
sends a fresh nonce with every identity query; the hospital signs ``run name | nonce | name`` with the
private key it also gives ``flower-supernode --auth-supernode-private-key`` (node config ``identity-key``),
and the server verifies the signature with that hospital's registered public key (run config
``hospital-keys``: a folder of ``<hospital>.pub``, the files ``deploy/register_hospitals.sh`` registers).
A node that cannot sign for the name it claims is refused. Keys are ECDSA P-384 in OpenSSH format
(``deploy/make_hospital_keys.sh``).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

IDENTITY_QUERY = "hospital-info"  #: the query config value of the server's question which hospital a node is
NONCE_KEY = "identity-nonce"  #: query config: what the hospital signs
SIGNATURE_KEY = "signature"  #: identity reply: the signature, bytes


def new_nonce() -> str:
    return secrets.token_hex(16)


def signed_text(run_name: str, nonce: str, name: str) -> bytes:
    return f"fedmed-identity|{run_name}|{nonce}|{name}".encode()


def sign_identity(private_key_file: str | Path, run_name: str, nonce: str, name: str) -> bytes:
    """The hospital's signature of its name for this query (ValueError naming the file if it is no key)."""
    return sign_statement(private_key_file, signed_text(run_name, nonce, name))


#: a key file as last read: path -> ((inode, size, modification time), the key); a key file replaced is read again
_KEYS: dict[tuple[Path, bool], tuple[tuple[int, int, int], object]] = {}


def _read_key(path: Path, private: bool) -> object:
    """The key in ``path``, parsed once while the file stays the same (a secure round checks dozens of signatures
    against the same few files). OSError or ValueError as the loader raises them."""
    status = path.stat()
    identity = (status.st_ino, status.st_size, status.st_mtime_ns)
    known = _KEYS.get((path, private))
    if known is not None and known[0] == identity:
        return known[1]
    data = path.read_bytes()
    key = load_ssh_private_key(data, password=None) if private else load_ssh_public_key(data)
    _KEYS[path, private] = (identity, key)
    return key


def sign_statement(private_key_file: str | Path, statement: bytes) -> bytes:
    """The hospital's ECDSA P-384 signature of ``statement`` with its identity key (ValueError naming the file)."""
    try:
        key = _read_key(Path(private_key_file).absolute(), private=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"node config key 'identity-key': cannot read private key {private_key_file} ({error})") \
            from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"node config key 'identity-key': {private_key_file} is not an ECDSA key")
    return key.sign(statement, ec.ECDSA(hashes.SHA384()))


def identity_problem(keys_folder: str | Path, run_name: str, nonce: str, name: str, signature: object) -> str | None:
    """Why the claim to be ``name`` is not proven (``None``: the signature verifies with ``<name>.pub``)."""
    if not isinstance(signature, bytes) or not signature:
        return f"it claims to be {name!r} but sent no signature (node config 'identity-key' unset?)"
    return statement_problem(keys_folder, name, signed_text(run_name, nonce, name), signature,
                             f"it claims to be {name!r} but its signature")


def statement_problem(keys_folder: str | Path, name: str, statement: bytes, signature: object,
                      claim: str = "") -> str | None:
    """Why ``signature`` is not ``name``'s signature of ``statement`` with its registered key ``<name>.pub`` in
    ``keys_folder`` (``None``: it is); ``claim`` begins the sentence for a signature that does not verify."""
    if not isinstance(signature, bytes) or not signature:
        return f"{name!r} sent no signature (node config 'identity-key' unset?)"
    key_file = Path(keys_folder) / f"{name}.pub"
    if not key_file.is_file():
        return f"no key is registered for {name!r} (expected {key_file})"
    try:
        key = _read_key(key_file.absolute(), private=False)
    except (OSError, ValueError) as error:
        return f"the registered key {key_file} cannot be read ({error})"
    if not isinstance(key, ec.EllipticCurvePublicKey):
        return f"the registered key {key_file} is not an ECDSA key"
    try:
        key.verify(signature, statement, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        return f"{claim or f'the signature in the name of {name!r}'} does not verify with {key_file}"
    return None
