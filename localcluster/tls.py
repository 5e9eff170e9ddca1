"""The emulated API server's HTTPS identity, and the kubeconfig that reaches it. kubectl sends a kubeconfig's
credentials over HTTPS only (client-go tools/clientcmd/client_config.go, `ClientConfig`, v0.32: "only try to
read the auth information if we are secure"), so the server that requires a bearer token serves TLS.

A certificate authority made for the one server signs the server's certificate, and its key is then dropped:
it can vouch for nothing else. Kubeconfigs trust that CA (certificate-authority-data), so a client checks the
server before it sends its token: a process of another user that takes the port once the server is gone
cannot present the certificate, and gets no token. The certificate file holds the server's certificate then
the CA's (a chain, as kube-apiserver's --tls-cert-file may); it is kept over restarts, so that the
kubeconfigs written before stay valid.

`kubeconfig` writes what kubectl, the operator (and kopf) read: the server's URL, the CA, a bearer token;
`Access` is the same read back, for this package's own HTTP clients (`local`) and the tests'.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .guard import write_private

NAMES = ("localhost",)  # the server's certificate names these hosts, and these addresses
ADDRESSES = ("127.0.0.1", "::1")
VALID_DAYS = 3650  # a private CA's certificate for one machine's server, made again by deleting the files
PEM_END = b"-----END CERTIFICATE-----\n"


def make(host: str = "127.0.0.1") -> tuple[bytes, bytes]:
    """A new identity for a server bound to `host`: (the chain, server certificate then CA certificate, PEM;
    the server's private key, PEM). The CA's key is not kept."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=VALID_DAYS)  # (clock skew)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "neuronfleet local mode CA")])
    ca_id = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(ca_id, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    try:
        addresses = {ipaddress.ip_address(a) for a in (*ADDRESSES, host)}
        names = set(NAMES)
    except ValueError:  # (a host name)
        addresses, names = {ipaddress.ip_address(a) for a in ADDRESSES}, {*NAMES, host}
    alt = [x509.DNSName(n) for n in sorted(names)] + [x509.IPAddress(a) for a in sorted(addresses, key=str)]
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "neuronfleet-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_id), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    chain = server.public_bytes(pem) + ca.public_bytes(pem)
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return chain, key_pem


def _usage(cert_sign: bool):
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign, encipher_only=False,
        decipher_only=False,
    )  # fmt: skip


def ensure(cert_file: Path, key_file: Path, host: str = "127.0.0.1") -> None:
    """The identity in these files, made (the key 0600) unless both exist."""
    if not (cert_file.exists() and key_file.exists()):
        chain, key = make(host)
        write_private(key_file, key)
        write_private(cert_file, chain)


def ca_of(cert_file: Path) -> bytes:
    """The CA certificate of a chain file `make` wrote (its last certificate), PEM: what kubeconfigs trust."""
    blocks = [b + PEM_END for b in cert_file.read_bytes().split(PEM_END) if b.strip()]
    if len(blocks) < 2:
        raise ValueError(f"{cert_file} holds no certificate chain (the server's certificate, then its CA's)")
    return blocks[-1]


def server_context(cert_file: Path | None, key_file: Path | None, host: str = "127.0.0.1"):
    """The server's TLS context and the CA's certificate (PEM), from the files (made where missing), or from
    an identity made now and held in memory only (its files written to a private folder, read, removed)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    if cert_file is not None and key_file is not None:
        ensure(cert_file, key_file, host)
        context.load_cert_chain(cert_file, key_file)
        return context, ca_of(cert_file)
    folder = Path(tempfile.mkdtemp(prefix="neuronfleet-tls-"))  # (0700)
    try:
        ensure(folder / "tls.crt", folder / "tls.key", host)
        context.load_cert_chain(folder / "tls.crt", folder / "tls.key")
        return context, ca_of(folder / "tls.crt")
    finally:
        shutil.rmtree(folder)


def client_context(ca: bytes) -> ssl.SSLContext:
    """A client's TLS context that trusts `ca` (PEM) only, host names checked."""
    return ssl.create_default_context(cadata=ca.decode())


def kubeconfig(server_url: str, token: str, ca: bytes, namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig for kubectl and kopf that points at the emulated server, trusts its CA and carries a
    user's bearer token."""
    cluster = {"server": server_url, "certificate-authority-data": base64.b64encode(ca).decode()}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "neuronfleet-local", "cluster": cluster}],
        "users": [{"name": "neuronfleet-local", "user": {"token": token}}],
        "contexts": [
            {
                "name": "neuronfleet-local",
                "context": {
                    "cluster": "neuronfleet-local",
                    "user": "neuronfleet-local",
                    "namespace": namespace,
                },
            }
        ],
        "current-context": "neuronfleet-local",
    }


@dataclass(frozen=True)
class Access:
    """What a kubeconfig `kubeconfig` wrote gives a client: the server's URL, the bearer token, and a TLS
    context that trusts the server's CA (None for a plain-HTTP server)."""

    url: str
    token: str
    context: ssl.SSLContext | None

    @classmethod
    def read(cls, path: Path) -> Access:
        """From the kubeconfig at `path` (its current context); ValueError for one that holds no token."""
        import yaml

        config = yaml.safe_load(path.read_text()) or {}
        try:
            context = next(c for c in config["contexts"] if c["name"] == config["current-context"])["context"]
            cluster = next(c for c in config["clusters"] if c["name"] == context["cluster"])["cluster"]
            user = next(u for u in config["users"] if u["name"] == context["user"])["user"]
            token, url = user["token"], cluster["server"]
        except (KeyError, StopIteration, TypeError):
            raise ValueError(f"{path} holds no server and bearer token for its current context") from None
        ca = cluster.get("certificate-authority-data")
        return cls(url, token, client_context(base64.b64decode(ca)) if ca else None)

    def headers(self, content_type: str | None = "application/json") -> dict[str, str]:
        """The Authorization header (and a Content-Type) of a request."""
        auth = {"Authorization": f"Bearer {self.token}"}
        return {**auth, "Content-Type": content_type} if content_type else auth
