"""Security of the agent as an operator deploys it: the exporter behind TLS and basic auth (a real
`sustain run` and a real HTTPS client, certificates made here with the openssl binary), database
passwords kept out of every output, and probe children started without credentials."""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from conftest import Running, fetch, start_agent
from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine, inspect, text

from agent.config import settings as config
from agent.config import webconfig
from agent.config.settings import DriftSection
from agent.drift.job import DriftJob
from agent.exporter.server import BasicAuth, ExporterApp, ExporterServer, ListenError
from agent.probes.runner import CPU, ProbeDevice, child_environment

SUSTAIN = [sys.executable, "-m", "agent"]
USER = "prometheus"
PASSWORD = "scrape-Pw-7c0ffee"
# bcrypt's smallest cost keeps the tests quick; the cost does not change what is tested.
PASSWORD_HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
DB_PASSWORD = "S3cretPw-d41d8"


def sustain(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    full_env.update(env or {})
    return subprocess.run(
        [*SUSTAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        check=False,
    )


# Certificates: a CA, a server certificate for 127.0.0.1 and localhost, a client certificate from
# the same CA, and a self-signed client certificate that no configured CA vouches for.


@dataclass(frozen=True)
class Pki:
    directory: Path

    def __getattr__(self, name: str) -> Path:
        return self.directory / name.replace("_", ".")


EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


def _openssl(directory: Path, *args: str) -> None:
    result = subprocess.run(
        ["openssl", *args], cwd=directory, capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"openssl {' '.join(args)} failed: {result.stderr.strip()}", pytrace=False)


def _signed(directory: Path, name: str, subject: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        directory,
        "req",
        "-new",
        *EC_KEY,
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        subject,
    )
    _openssl(
        directory,
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        f"{name}.crt",
        "-extfile",
        f"{name}.ext",
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.fail("the openssl binary is needed to make test certificates", pytrace=False)
    directory = tmp_path_factory.mktemp("pki")
    _openssl(
        directory,
        "req",
        "-x509",
        *EC_KEY,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=sustain test CA",
    )
    _signed(
        directory,
        "server",
        "/CN=localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    _signed(directory, "client", f"/CN={USER}", "extendedKeyUsage=clientAuth\n")
    _openssl(
        directory,
        "req",
        "-x509",
        *EC_KEY,
        "-keyout",
        "rogue.key",
        "-out",
        "rogue.crt",
        "-days",
        "2",
        "-subj",
        f"/CN={USER}",
    )
    _openssl(
        directory,
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-aes-128-cbc",
        "-pass",
        "pass:secret",
        "-out",
        "encrypted.key",
    )
    return Pki(directory)


def client_context(pki: Pki, cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca_crt)
    if cert is not None:
        context.load_cert_chain(pki.directory / f"{cert}.crt", pki.directory / f"{cert}.key")
    return context


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def https(
    url: str, context: ssl.SSLContext, authorization: str | None = None
) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            return int(response.status), dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def write_web_config(directory: Path, text: str) -> Path:
    path = directory / "web.yml"
    path.write_text(text)
    return path


def write_toml(directory: Path, text: str, mode: int = 0o600) -> Path:
    path = directory / "sustain.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


QUIET = "[probing]\nenabled = false\n\n[drift]\nenabled = false\n"


def agent_config(directory: Path, web_config: Path) -> Path:
    return write_toml(directory, f'[exporter]\nweb_config_file = "{web_config}"\n\n{QUIET}')


def wait_https(running: Running, context: ssl.SSLContext, authorization: str | None) -> str:
    """/metrics over HTTPS once host metrics are in (up to 120 s: a loaded machine's start-up)."""
    base = f"https://127.0.0.1:{running.port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            _, err = running.process.communicate()
            pytest.fail(f"agent exited {running.process.returncode}: {err}")
        try:
            status, _, body = https(base + "/metrics", context, authorization)
        except OSError:
            time.sleep(0.3)
            continue
        if status == 200 and "sustain_cpu_utilization_ratio " in body:
            return body
        time.sleep(0.3)
    pytest.fail("the agent did not serve host metrics over HTTPS within 120 s")


@pytest.fixture
def agents() -> Iterator[list[Running]]:
    started: list[Running] = []
    yield started
    for running in started:
        if running.process.poll() is None:
            running.process.kill()
            running.process.communicate()


# 1. TLS and basic auth, end to end.


@pytest.mark.slow
def test_https_with_basic_auth(pki: Pki, tmp_path: Path, agents: list[Running]) -> None:
    web = write_web_config(
        tmp_path,
        f"tls_server_config:\n  cert_file: {pki.server_crt}\n  key_file: {pki.server_key}\n"
        f"  min_version: TLS12\nbasic_auth_users:\n  {USER}: {PASSWORD_HASH}\n",
    )
    running = start_agent(tmp_path, "--config", str(agent_config(tmp_path, web)))
    agents.append(running)
    context = client_context(pki)
    base = f"https://127.0.0.1:{running.port}"

    body = wait_https(running, context, basic(USER, PASSWORD))
    assert "sustain_build_info" in body

    for authorization in (None, basic(USER, "wrong-password"), basic("nobody", PASSWORD)):
        status, headers, body = https(base + "/metrics", context, authorization)
        assert status == 401, authorization
        assert headers["WWW-Authenticate"] == 'Basic realm="sustain"'
        assert "sustain_" not in body
    assert https(base + "/", context)[0] == 401
    assert https(base + "/", context, basic(USER, PASSWORD))[0] == 200
    # Liveness probes cannot send credentials; /healthz says only "ok" or what stalled.
    status, _, body = https(base + "/healthz", context)
    assert (status, body) == (200, "ok\n")
    tls12 = client_context(pki)
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2  # min_version TLS12 lets it in
    assert https(base + "/healthz", tls12)[0] == 200

    # Plain HTTP to the TLS port gets no HTTP answer, let alone metrics.
    with pytest.raises((OSError, http.client.HTTPException)):
        fetch(f"http://127.0.0.1:{running.port}/metrics", timeout=5)
    with socket.create_connection(("127.0.0.1", running.port), timeout=5) as raw:
        raw.sendall(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        received = b""
        try:
            while chunk := raw.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    assert not received.startswith(b"HTTP/")
    assert b"sustain_" not in received

    code, _, err = running.terminate()
    assert code == 0, err
    assert "Traceback" not in err
    assert PASSWORD not in err
    assert "exporter: TLS (TLS12 or newer), basic auth for 1 user(s)" in err


@pytest.mark.slow
def test_client_certificate_required(pki: Pki, tmp_path: Path, agents: list[Running]) -> None:
    web = write_web_config(
        tmp_path,
        f"tls_server_config:\n  cert_file: {pki.server_crt}\n  key_file: {pki.server_key}\n"
        "  client_auth_type: RequireAndVerifyClientCert\n"
        f"  client_ca_file: {pki.ca_crt}\n",
    )
    running = start_agent(tmp_path, "--config", str(agent_config(tmp_path, web)))
    agents.append(running)
    base = f"https://127.0.0.1:{running.port}"

    assert "sustain_build_info" in wait_https(running, client_context(pki, "client"), None)
    for context in (client_context(pki), client_context(pki, "rogue")):
        with pytest.raises((OSError, http.client.HTTPException)):
            https(base + "/metrics", context)
    code, _, err = running.terminate()
    assert code == 0, err
    assert "Traceback" not in err


BAD_WEB_CONFIGS = [
    pytest.param(
        "tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n  cipher_suite: [x]\n",
        "tls_server_config.cipher_suite: unknown key",
        id="unknown-key",
    ),
    pytest.param(
        "tls_server_config:\n  cert_file: {dir}/absent.crt\n  key_file: {key}\n",
        "tls_server_config.cert_file: no such file",
        id="missing-cert",
    ),
    pytest.param(
        f"basic_auth_users:\n  {USER}: {PASSWORD}\n",
        f"basic_auth_users.{USER}: not a bcrypt hash",
        id="not-bcrypt",
    ),
    pytest.param(  # was a traceback: OSError from is_file()
        "tls_server_config:\n  cert_file: " + "a" * 300 + "\n  key_file: {key}\n",
        "tls_server_config.cert_file: cannot use the path: File name too long",
        id="name-too-long",
    ),
    pytest.param("[" * 5000 + "\n", "YAML nested too deeply", id="deep-nesting"),  # RecursionError
]


@pytest.mark.parametrize(("yaml_text", "expected"), BAD_WEB_CONFIGS)
def test_bad_web_config_is_one_line_and_exit_2(
    pki: Pki, tmp_path: Path, yaml_text: str, expected: str
) -> None:
    web = write_web_config(
        tmp_path, yaml_text.format(crt=pki.server_crt, key=pki.server_key, dir=tmp_path)
    )
    toml = agent_config(tmp_path, web)

    checked = sustain("config", "check", str(toml))
    assert checked.returncode == 2, checked
    (line,) = checked.stdout.splitlines()
    assert line.startswith(f"{toml}: exporter.web_config_file: {expected}"), line
    assert line.endswith(f"(got {str(web)!r})"), line

    ran = sustain("run", "--config", str(toml), "--data-dir", str(tmp_path), "--listen", ":0")
    assert ran.returncode == 2, ran
    assert len(ran.stderr.splitlines()) == 1, ran.stderr
    assert f"exporter.web_config_file: {expected}" in ran.stderr
    for output in (checked.stdout, ran.stderr):
        assert PASSWORD not in output  # a plain-text password put as a hash is not echoed


def test_a_long_path_keeps_the_name_of_the_file_at_fault(pki: Pki, tmp_path: Path) -> None:
    """The web configuration file is named in full however deep it lies (a pytest-xdist worker's
    tmp_path, a Kubernetes volume): the message before its name is cut short, never the name."""
    directory = tmp_path / ("volume-" + "d" * 90) / ("configmap-" + "e" * 90)
    directory.mkdir(parents=True)
    web = write_web_config(
        directory,
        f"tls_server_config:\n  cert_file: {directory}/absent.crt\n  key_file: {pki.server_key}\n",
    )
    toml = agent_config(directory, web)
    checked = sustain("config", "check", str(toml))
    assert checked.returncode == 2, checked
    (line,) = checked.stdout.splitlines()
    assert line.startswith(f"{toml}: exporter.web_config_file: "), line
    assert f"tls_server_config.cert_file: no such file: {str(directory)[:50]}" in line, line
    assert line.endswith(f"... (got {str(web)!r})"), line


# The web configuration file in process: every refusal is one line that names the key.


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("- a list\n", "(top level): expected a mapping, got list"),
        ("tls_server_config: [\n", "YAML syntax error"),
        ("http_server_config:\n  http2: false\n", "http_server_config: not supported by sustain"),
        ("tls_server_config:\n  cert_file: {crt}\n", "tls_server_config.key_file: missing"),
        (
            "tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n  min_version: TLS11\n",
            "tls_server_config.min_version: 'TLS11' is not supported (use TLS12 or TLS13)",
        ),
        (
            "tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n"
            "  client_auth_type: RequestClientCert\n",
            "tls_server_config.client_auth_type: 'RequestClientCert' is not supported",
        ),
        (
            "tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n  client_ca_file: {ca}\n",
            "tls_server_config.client_ca_file: set without client_auth_type",
        ),
        (
            "tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n"
            "  client_auth_type: RequireAndVerifyClientCert\n",
            "tls_server_config.client_ca_file: missing",
        ),
        (
            "tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n  cert: inline\n",
            "tls_server_config.cert: not supported by sustain",
        ),
        ('basic_auth_users:\n  "a:b": {hash}\n', "basic_auth_users.a:b: a user name cannot"),
        (
            "basic_auth_users:\n  u: $2y$03$" + "a" * 53 + "\n",
            "basic_auth_users.u: bcrypt cost 3 is outside 4-31",
        ),
    ],
)
def test_web_config_refusals(pki: Pki, tmp_path: Path, yaml_text: str, expected: str) -> None:
    text_ = yaml_text.format(
        crt=pki.server_crt, key=pki.server_key, ca=pki.ca_crt, hash=PASSWORD_HASH
    )
    with pytest.raises(webconfig.WebConfigError) as raised:
        webconfig.load(write_web_config(tmp_path, text_))
    assert str(raised.value).startswith(expected), str(raised.value)
    assert "\n" not in str(raised.value)


def test_web_config_relative_paths_and_defaults(pki: Pki) -> None:
    path = write_web_config(
        pki.directory, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
    )
    web = webconfig.load(path)
    assert web.tls == webconfig.TlsSettings(pki.server_crt, pki.server_key)  # TLS12, no certs
    assert web.users == {}
    assert webconfig.load(write_web_config(pki.directory, "")).tls is None  # empty: plain HTTP


def test_key_problems_are_found_by_config_check(pki: Pki, tmp_path: Path) -> None:
    """The key is read by `config check` and the server, not by every command."""
    for key, expected in (
        ("client.key", "is not the key of"),  # another certificate's key
        ("ca.crt", "no PEM private key in"),
        ("encrypted.key", "the key is encrypted"),  # and no passphrase prompt that hangs
    ):
        web = write_web_config(
            tmp_path,
            f"tls_server_config:\n  cert_file: {pki.server_crt}\n"
            f"  key_file: {pki.directory / key}\n",
        )
        toml = agent_config(tmp_path, web)
        assert config.load(toml, use_env=False).exporter.web_config_file == web
        (problem,) = config.check_file(toml)
        assert problem.startswith(f"{toml}: exporter.web_config_file: tls_server_config"), problem
        assert expected in problem
        with pytest.raises(ListenError, match=expected):
            ExporterServer("127.0.0.1", 0, ExporterApp(CollectorRegistry(), lambda: []), web)


def test_min_version_tls13_refuses_tls12(pki: Pki, tmp_path: Path) -> None:
    web = write_web_config(
        tmp_path,
        f"tls_server_config:\n  cert_file: {pki.server_crt}\n  key_file: {pki.server_key}\n"
        "  min_version: TLS13\n",
    )
    exporter = ExporterServer("127.0.0.1", 0, ExporterApp(CollectorRegistry(), lambda: []), web)
    exporter.start()
    try:
        url = f"https://127.0.0.1:{exporter.port}/healthz"
        assert https(url, client_context(pki))[0] == 200
        tls12 = client_context(pki)
        tls12.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(urllib.error.URLError):
            https(url, tls12)
    finally:
        exporter.stop()


def test_certificate_rotation_is_picked_up(pki: Pki, tmp_path: Path) -> None:
    """Replacing the certificate files takes effect on the next connection, as in Prometheus."""
    for name in ("server.crt", "server.key"):
        shutil.copy(pki.directory / name, tmp_path / name)
    web = write_web_config(
        tmp_path, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
    )
    exporter = ExporterServer("127.0.0.1", 0, ExporterApp(CollectorRegistry(), lambda: []), web)
    exporter.start()
    try:
        context = client_context(pki, None)

        def serial() -> int:
            with (
                socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                cert: Any = tls.getpeercert()
                return int(cert["serialNumber"], 16)

        before = serial()
        _signed(
            pki.directory,
            "rotated",
            "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        )
        (tmp_path / "server.key").write_bytes(pki.rotated_key.read_bytes())
        (tmp_path / "server.crt").write_bytes(pki.rotated_crt.read_bytes())
        after = serial()
        assert after != before
        assert https(f"https://127.0.0.1:{exporter.port}/healthz", context)[0] == 200
    finally:
        exporter.stop()


# Basic auth in process: what the cache and the dummy hash do.


@pytest.fixture
def bcrypt_calls(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The hashes bcrypt.checkpw is called with, as the server calls it."""
    calls: list[bytes] = []
    real: Callable[[bytes, bytes], bool] = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(hashed)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    return calls


def test_basic_auth_remembers_checks_and_hides_unknown_users(bcrypt_calls: list[bytes]) -> None:
    auth = BasicAuth({USER: PASSWORD_HASH.encode()})
    assert auth.check(basic(USER, PASSWORD))
    assert auth.check(basic(USER, PASSWORD))  # remembered: no second bcrypt
    assert bcrypt_calls == [PASSWORD_HASH.encode()]

    assert not auth.check(basic(USER, "wrong"))
    assert not auth.check(basic(USER, "wrong"))  # remembered as wrong: one bcrypt, not two
    assert len(bcrypt_calls) == 2

    # An unknown user costs a bcrypt check too, against a dummy hash of the same cost.
    assert not auth.check(basic("nobody", PASSWORD))
    dummy = bcrypt_calls[-1]
    assert dummy != PASSWORD_HASH.encode()
    assert dummy[4:6] == PASSWORD_HASH.encode()[4:6] == b"04"
    assert len(bcrypt_calls) == 3

    # Nothing that is not Basic credentials gets as far as bcrypt.
    for header in (None, "", "Bearer x", "Basic !!!", "Basic " + base64.b64encode(b"x").decode()):
        assert not auth.check(header)
    assert len(bcrypt_calls) == 3


def test_basic_auth_refuses_passwords_past_bcrypts_72_bytes() -> None:
    """bcrypt reads 72 bytes; a longer password matching in those must not pass."""
    long_password = "p" * 72
    auth = BasicAuth({USER: bcrypt.hashpw(long_password.encode(), bcrypt.gensalt(4))})
    assert auth.check(basic(USER, long_password))
    assert not auth.check(basic(USER, long_password + "and more"))


def test_basic_auth_under_concurrent_scrapes() -> None:
    """Threads of the server share one BasicAuth: every right check passes, every wrong fails."""
    auth = BasicAuth({USER: PASSWORD_HASH.encode()})
    results: list[tuple[bool, bool]] = []

    def scrape(index: int) -> None:
        right = index % 2 == 0
        results.append((right, auth.check(basic(USER, PASSWORD if right else f"bad{index}"))))

    threads = [threading.Thread(target=scrape, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 16
    assert all(right == accepted for right, accepted in results)


# 3. Database passwords stay out of every output.


@pytest.mark.slow
def test_database_password_never_shown(
    postgres_url: str, tmp_path: Path, agents: list[Running]
) -> None:
    url = postgres_url.replace("postgres@", f"postgres:{DB_PASSWORD}@")
    assert DB_PASSWORD in url
    # Readable by others on purpose: the agent must say so.
    toml = write_toml(tmp_path, f'[archive]\ndatabase_url = "{url}"\n\n{QUIET}', mode=0o644)
    secrets_env = {
        "CUDA_API_TOKEN": DB_PASSWORD,
        "AWS_SECRET_ACCESS_KEY": DB_PASSWORD,
        "PGPASSWORD": DB_PASSWORD,
        "NCCL_DEBUG_FILE": f"postgresql://postgres:{DB_PASSWORD}@127.0.0.1/x",
    }
    running = start_agent(tmp_path, "--config", str(toml), "--log-level", "debug", env=secrets_env)
    agents.append(running)
    metrics = running.wait_for("sustain_cpu_utilization_ratio ", timeout=120)
    engine = create_engine(postgres_url)
    try:
        deadline = time.monotonic() + 180
        while True:
            with engine.connect() as connection:
                if connection.execute(text("SELECT count(*) FROM stack_snapshots")).scalar():
                    break
            if time.monotonic() > deadline:
                pytest.fail("no stack snapshot archived within 180 s")
            time.sleep(0.5)
        metrics += running.wait_for("sustain_stack_info", timeout=120)
        code, _, log = running.terminate()
        assert code == 0, log
        with engine.connect() as connection:
            dump = {
                table: repr(connection.execute(text(f'SELECT * FROM "{table}"')).fetchall())
                for table in inspect(connection).get_table_names()
            }
    finally:
        engine.dispose()
    assert "stack_snapshots" in dump
    assert "events" in dump
    assert "postgres:***@" in log  # the agent did log its archive, redacted
    for name, output in {"agent log": log, "/metrics": metrics, **dump}.items():
        assert DB_PASSWORD not in output, name
    warnings = [line for line in log.splitlines() if "is readable by others" in line]
    assert warnings == [
        f"sustain: warning: config file {toml} is readable by others and holds a database "
        "password; chmod 600 it (or set the password in the environment: docs/security.md)"
    ]

    shown = sustain("config", "show", "--config", str(toml))
    assert shown.returncode == 0, shown.stderr
    assert "postgres:***@" in shown.stdout
    assert DB_PASSWORD not in shown.stdout

    stack = sustain(
        "stack", "show", "--json", env={**secrets_env, "SUSTAIN_ARCHIVE__DATABASE_URL": url}
    )
    assert stack.returncode == 0, stack.stderr
    assert '"environment"' in stack.stdout
    assert DB_PASSWORD not in stack.stdout + stack.stderr


@pytest.mark.slow
def test_database_password_not_in_connection_errors(tmp_path: Path) -> None:
    unreachable = {
        "SUSTAIN_ARCHIVE__DATABASE_URL": f"postgresql+psycopg://postgres:{DB_PASSWORD}@127.0.0.1:1/x"
    }
    result = sustain("db", "current", env=unreachable)
    assert result.returncode == 2, result
    (line,) = result.stderr.splitlines()
    assert "postgres:***@127.0.0.1:1" in line
    assert DB_PASSWORD not in line
    # The daemon keeps running without its database (docs/archive.md) and says why in its log.
    agent = start_agent(tmp_path, env=unreachable)
    agent.wait_for("sustain_archive_up 0")
    code, _, err = agent.terminate()
    assert code == 0, err
    assert "postgres:***@127.0.0.1:1" in err
    assert DB_PASSWORD not in err


def test_drift_child_gets_the_database_url_on_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ps` shows a child's command line to every user: the URL goes on standard input."""
    url = f"postgresql+psycopg://sustain:{DB_PASSWORD}@db:5432/fleet"
    seen: dict[str, Any] = {}

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen["argv"], seen["kwargs"] = argv, kwargs
        return subprocess.CompletedProcess(argv, 0, '{"drifts": [], "outliers": []}', "")

    monkeypatch.setattr(subprocess, "run", run)
    assert DriftJob(DriftSection(), url, "node-1", None).run() is not None
    assert not any(DB_PASSWORD in arg for arg in seen["argv"])
    assert DB_PASSWORD in seen["kwargs"]["input"]


def test_config_check_warns_about_a_password_others_can_read(tmp_path: Path) -> None:
    with_password = '[archive]\ndatabase_url = "postgresql+psycopg://u:pw@db:5432/x"\n'
    toml = write_toml(tmp_path, with_password, mode=0o644)
    result = sustain("config", "check", str(toml))
    assert (result.returncode, result.stdout) == (0, "ok\n")
    assert result.stderr.splitlines() == [
        f"sustain: warning: config file {toml} is readable by others and holds a database "
        "password; chmod 600 it (or set the password in the environment: docs/security.md)"
    ]


def test_exposed_password_warning_is_one_line_per_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with_password = '[archive]\ndatabase_url = "postgresql+psycopg://u:pw@db:5432/x"\n'
    for text_, mode, warned in (
        (with_password, 0o644, True),
        (with_password, 0o640, True),  # the group counts as others
        (with_password, 0o600, False),
        ('[archive]\ndatabase_url = "postgresql+psycopg://u@db:5432/x"\n', 0o644, False),
    ):
        assert config.check_file(write_toml(tmp_path, text_, mode=mode)) == []
        err = capsys.readouterr().err
        assert ("is readable by others" in err) == warned, (oct(mode), text_)
        assert "pw@" not in err


# 4. Probe children get a minimal environment.


@pytest.mark.parametrize("device", [CPU, ProbeDevice(kind="cuda", key="GPU-1234", label="gpu0")])
def test_probe_children_get_no_credentials(device: ProbeDevice) -> None:
    agent_env = {
        "PATH": "/usr/bin",
        "HOME": "/var/lib/sustain",
        "CUDA_CACHE_PATH": "/var/cache/sustain/cuda",
        "NCCL_DEBUG": "WARN",
        "NCCL_IB_PKEY": "0x8001",  # an InfiniBand partition key, not a secret
        "CUDA_API_TOKEN": DB_PASSWORD,
        "TORCH_HUB_AUTH": DB_PASSWORD,
        "NCCL_PASSWORD": DB_PASSWORD,
        "CUDA_LOG_URL": f"https://user:{DB_PASSWORD}@logs.example/",
        "SUSTAIN_ARCHIVE__DATABASE_URL": f"postgresql+psycopg://u:{DB_PASSWORD}@db/x",
        "AWS_SECRET_ACCESS_KEY": DB_PASSWORD,
        "PGPASSWORD": DB_PASSWORD,
        "DATABASE_URL": f"postgresql://u:{DB_PASSWORD}@db/x",
    }
    env = child_environment(device, agent_env)
    assert DB_PASSWORD not in repr(env)
    assert {
        k: env[k] for k in ("PATH", "HOME", "CUDA_CACHE_PATH", "NCCL_DEBUG", "NCCL_IB_PKEY")
    } == {
        k: agent_env[k] for k in ("PATH", "HOME", "CUDA_CACHE_PATH", "NCCL_DEBUG", "NCCL_IB_PKEY")
    }
    assert env["CUDA_VISIBLE_DEVICES"] == ("" if device.kind == "cpu" else "GPU-1234")
