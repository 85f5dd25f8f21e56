"""Throw-away TLS certificates and SuperNode keys for rehearsing a fedfm deployment.

Usage (from the repository root)::

    .venv/bin/python simulations/deploy/certificates.py OUT [--nodes 3] [--name HOST ...]

Writes, with Python's ``cryptography`` package (no ``openssl`` or ``ssh-keygen`` needed):

=================  ===========================================================================
``OUT/ca.crt``     a self-signed certificate authority: the trust anchor every SuperNode
                   (``--root-certificates``) and every ``flwr`` CLI connection
                   (``root-certificates``) verifies the SuperLink with
``OUT/ca.key``     its private key (only needed to sign ``server.crt``)
``OUT/server.crt`` the SuperLink's certificate, signed by the CA, valid for ``localhost``,
                   ``127.0.0.1``, ``::1`` and every ``--name`` (DNS name or IP address)
``OUT/server.key`` its private key (``flower-superlink --ssl-keyfile``)
``OUT/node-K.key`` SuperNode K's ECDSA P-384 private key in OpenSSH format, as
                   ``ssh-keygen -t ecdsa -b 384`` writes it
                   (``flower-supernode --auth-supernode-private-key``)
``OUT/node-K.pub`` its public key in OpenSSH format (``flwr supernode register``)
=================  ===========================================================================

With ``--node-key NAME`` it writes only ``OUT/NAME.key`` and ``OUT/NAME.pub``: a site's own key.
Private keys are written unencrypted with mode 0600. These files are for one machine and a
short rehearsal: a real deployment takes the SuperLink's certificate from the organisation's CA
and each site makes its own node key (see ``docs/deployment.md``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Credentials:
    """The paths :func:`make_credentials` wrote."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    node_keys: tuple[Path, ...]
    node_public_keys: tuple[Path, ...]


def _write(path: Path, data: bytes, *, private: bool) -> Path:
    """Write ``data`` to ``path``; private files are created with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    return path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _subject_names(names: tuple[str, ...]) -> list[x509.GeneralName]:
    """``names`` as subject alternative names: IP addresses where they parse, else DNS names."""
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # keep order, drop repeats
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def make_ca(days: int = 30) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed certificate authority that may sign end-entity certificates only."""
    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedfm rehearsal CA")])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA384())
    )
    return key, cert


def make_server_certificate(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    names: tuple[str, ...] = LOCAL_NAMES,
    days: int = 30,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS server certificate for ``names`` (DNS names or IP addresses), signed by the CA."""
    if not names:
        raise ValueError("a server certificate needs at least one name")
    key = ec.generate_private_key(ec.SECP384R1())
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    ca_public = ca_cert.public_key()
    if not isinstance(ca_public, ec.EllipticCurvePublicKey):
        raise TypeError("the CA certificate must carry an elliptic-curve key (make_ca makes one)")
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(_subject_names(names)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )
    return key, cert


def make_node_key() -> tuple[bytes, bytes]:
    """A SuperNode's ECDSA P-384 key pair as OpenSSH (private, public) file contents.

    The same formats as ``ssh-keygen -t ecdsa -b 384 -N ''``: Flower 1.41 reads the private key
    with ``load_ssh_private_key`` and ``flwr supernode register`` the public key with
    ``load_ssh_public_key`` (NIST curves only).
    """
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return private, public + b" fedfm-supernode\n"


def write_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Write ``folder/name.key`` (private) and ``folder/name.pub`` (public); return both."""
    private, public = make_node_key()
    return (
        _write(folder / f"{name}.key", private, private=True),
        _write(folder / f"{name}.pub", public, private=False),
    )


def make_credentials(
    folder: Path, *, nodes: int = 3, names: tuple[str, ...] = (), days: int = 30
) -> Credentials:
    """Write a CA, a SuperLink certificate and ``nodes`` SuperNode key pairs into ``folder``."""
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    ca_key, ca_cert = make_ca(days)
    server_key, server_cert = make_server_certificate(ca_key, ca_cert, (*LOCAL_NAMES, *names), days)
    pem = serialization.Encoding.PEM
    pairs = [write_node_key(folder, f"node-{k}") for k in range(nodes)]
    return Credentials(
        ca_cert=_write(folder / "ca.crt", ca_cert.public_bytes(pem), private=False),
        ca_key=_write(folder / "ca.key", _key_pem(ca_key), private=True),
        server_cert=_write(folder / "server.crt", server_cert.public_bytes(pem), private=False),
        server_key=_write(folder / "server.key", _key_pem(server_key), private=True),
        node_keys=tuple(private for private, _ in pairs),
        node_public_keys=tuple(public for _, public in pairs),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the files")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNode key pairs (3)")
    parser.add_argument(
        "--name",
        action="append",
        default=[],
        help="another DNS name or IP address of the SuperLink (repeatable); "
        "localhost, 127.0.0.1 and ::1 are always included",
    )
    parser.add_argument("--days", type=int, default=30, help="validity in days (30)")
    parser.add_argument(
        "--node-key",
        metavar="NAME",
        help="write only one SuperNode key pair, FOLDER/NAME.key and FOLDER/NAME.pub (what a "
        "site runs to make its own key)",
    )
    args = parser.parse_args(argv)
    if args.node_key:
        for path in write_node_key(args.folder, args.node_key):
            print(path)
        return 0
    made = make_credentials(args.folder, nodes=args.nodes, names=tuple(args.name), days=args.days)
    for path in (made.ca_cert, made.ca_key, made.server_cert, made.server_key):
        print(path)
    for private, public in zip(made.node_keys, made.node_public_keys, strict=True):
        print(private)
        print(public)
    return 0


if __name__ == "__main__":
    sys.exit(main())
