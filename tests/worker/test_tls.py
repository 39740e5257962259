"""Redis over TLS, mutual: a redis-server on loopback that requires client certificates, made by
the test's own certificate authority (trustme). The producer, the CLI and the worker take the
CA, certificate and key as the URL's query parameters (redis-py's ssl_* options); a server the
client does not trust, and a client without a certificate, are refused at once, never retried.
(Under TLS 1.3 the server checks the client's certificate after the handshake, and a client
without one may see its alert or only a closed connection, which it retries as a lost one:
the refusal test of that case runs the server on TLS 1.2, where the handshake itself fails.)"""

import time
from urllib.parse import urlencode

import pytest
import redis
import trustme

from producer import Producer
from producer.cli import main
from producer.errors import Disconnected
from tests.conftest import private_redis

from .conftest import greedy, is_finished, offline, run_until


@pytest.fixture(params=["TLSv1.2 TLSv1.3"])
def tls(request, tmp_path):
    """-> (a function making a rediss:// URL with given files, the files by name); the server's
    TLS versions are the fixture's parameter."""
    authority, stranger = trustme.CA(), trustme.CA()
    server, client = authority.issue_cert("127.0.0.1", "localhost"), authority.issue_cert("streambatch-client")
    files = {"ca": tmp_path / "ca.pem", "stranger": tmp_path / "stranger.pem", "server": tmp_path / "server.pem",
             "server_key": tmp_path / "server.key", "cert": tmp_path / "client.pem", "key": tmp_path / "client.key"}
    authority.cert_pem.write_to_path(files["ca"])
    stranger.cert_pem.write_to_path(files["stranger"])
    server.cert_chain_pems[0].write_to_path(files["server"])
    server.private_key_pem.write_to_path(files["server_key"])
    client.cert_chain_pems[0].write_to_path(files["cert"])
    client.private_key_pem.write_to_path(files["key"])
    server_flags = ("--tls-cert-file", str(files["server"]), "--tls-key-file", str(files["server_key"]),
                    "--tls-ca-cert-file", str(files["ca"]), "--tls-auth-clients", "yes",
                    "--tls-protocols", request.param)
    trusted = {"ssl_ca_certs": str(files["ca"]), "ssl_certfile": str(files["cert"]), "ssl_keyfile": str(files["key"])}
    with private_redis(tmp_path, options=server_flags, tls=trusted) as (base, _):
        def url(ca="ca", cert="cert", key="key") -> str:
            options = {"ssl_ca_certs": files[ca]} | ({"ssl_certfile": files[cert], "ssl_keyfile": files[key]}
                                                       if cert else {})
            return f"{base}?{urlencode({name: str(path) for name, path in options.items()})}"

        yield url, files


def test_a_whole_request_over_mutual_tls_from_producer_cli_and_worker(tls, make_worker, model, capsys):
    url, _ = tls
    worker = make_worker(redis_url=url())
    with Producer(url()) as producer:
        handle = producer.submit(prompt_ids=[5, 6, 7], params=greedy(5), request_id="tls")
        run_until([worker], lambda: is_finished(producer.redis, "tls"))
        assert handle.result(timeout=10).token_ids == offline(model, [[5, 6, 7]], [greedy(5)])[0]
    assert main(["--redis-url", url(), "result", "tls"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("tls, options", [
    ("TLSv1.2 TLSv1.3", {"ca": "stranger"}),  # a server whose certificate the client does not trust
    ("TLSv1.2", {"cert": None}),  # a client without a certificate
], indirect=["tls"], ids=["untrusted server", "client without a certificate"])
def test_a_refused_tls_handshake_is_an_error_at_once_never_a_retry(tls, make_worker, capsys, options):
    url, _ = tls
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError) as raised, Producer(url(**options)) as producer:
        producer.submit(prompt_ids=[5], request_id="no")
    assert not isinstance(raised.value, Disconnected), "a retry would never succeed"
    assert main(["--redis-url", url(**options), "submit", "x"]) == 1
    with pytest.raises(redis.ConnectionError, match="SSL|certificate"):
        make_worker(redis_url=url(**options))  # a worker does not wait for a Redis it will never reach
    assert time.monotonic() - started < 5, "refused at once, not after the submit's patience (10 s)"
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
