"""A throwaway kube-apiserver + etcd for tests, in the spirit of controller-runtime's envtest.

The binaries come from ``tools/build-kube-tools.sh``, which builds them into
``${VACANCYD_TOOLS_CACHE:-~/.cache/vacancyd-tools}/kube/bin``. Tests call
:func:`require_kube_tools` first: it skips the test when a binary is missing, or
fails it when ``VACANCYD_REQUIRE_TOOLS=1`` (CI), so a broken tool build cannot pass
silently as a run of skips.

:func:`running_apiserver` starts etcd and kube-apiserver on free loopback ports
with everything under one directory, waits until the API server is ready and
yields an :class:`ApiServer` with a kubeconfig for an admin user (group
``system:masters``) and one for a "limited" user that RBAC grants only what every
authenticated user gets. No controllers, scheduler or kubelet run: objects such as
Nodes are created and changed through the API only, and nothing reconciles them.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TOOLS_CACHE_ENV = "VACANCYD_TOOLS_CACHE"
REQUIRE_TOOLS_ENV = "VACANCYD_REQUIRE_TOOLS"
BUILD_HINT = "build them with tools/build-kube-tools.sh"

#: Binaries that :func:`running_apiserver` needs.
APISERVER_TOOLS: tuple[str, ...] = ("etcd", "kube-apiserver", "openssl")

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
ADMIN_USER = "vacancyd-admin"
LIMITED_USER = "vacancyd-limited"

_LOG_TAIL_BYTES = 4000


def tools_cache_dir() -> Path:
    """Return the tool cache root: ``$VACANCYD_TOOLS_CACHE`` or ``~/.cache/vacancyd-tools``."""
    configured = os.environ.get(TOOLS_CACHE_ENV)
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "vacancyd-tools"


def tools_bin_dir() -> Path:
    """Return the directory that ``tools/build-kube-tools.sh`` fills with binaries."""
    return tools_cache_dir() / "kube" / "bin"


def kube_tool(name: str) -> Path | None:
    """Find the executable ``name``: first in the tool cache, then on ``PATH``.

    Returns ``None`` when it is in neither place.
    """
    cached = tools_bin_dir() / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    found = shutil.which(name)
    return Path(found) if found else None


def require_kube_tools(*names: str) -> dict[str, Path]:
    """Return the paths of the named tools, or end the calling test if one is missing.

    With no names, checks :data:`APISERVER_TOOLS` plus ``kubectl``. A missing tool
    skips the test, unless ``VACANCYD_REQUIRE_TOOLS=1`` is set (as CI does), in which
    case the test fails instead.
    """
    wanted = names or (*APISERVER_TOOLS, "kubectl")
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in wanted:
        path = kube_tool(name)
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if missing:
        message = (
            f"kube test tools missing: {', '.join(missing)} "
            f"(looked in {tools_bin_dir()} and on PATH); {BUILD_HINT}"
        )
        if os.environ.get(REQUIRE_TOOLS_ENV) == "1":
            pytest.fail(f"{message} [{REQUIRE_TOOLS_ENV}=1]", pytrace=False)
        pytest.skip(message)
    return found


@dataclass(frozen=True)
class ApiServer:
    """A running test API server and the credentials to reach it."""

    url: str
    """``https://127.0.0.1:<port>``."""
    kubeconfig: Path
    """Kubeconfig file for the admin user (token auth, group ``system:masters``)."""
    limited_kubeconfig: Path
    """Kubeconfig file for the limited user (no group beyond ``system:authenticated``)."""
    admin_token: str
    limited_token: str
    ca_file: Path
    """PEM file of the CA that signed the serving certificate."""
    etcd_url: str
    workdir: Path
    """Directory holding certificates, logs and the kubectl cache."""
    kubectl_path: Path | None = field(default=None)

    @property
    def log_dir(self) -> Path:
        """Directory with ``etcd.log`` and ``kube-apiserver.log``."""
        return self.workdir / "logs"

    def kubectl(
        self,
        *args: str,
        limited: bool = False,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl`` against this server and return the finished process.

        Uses the admin kubeconfig, or the limited one when ``limited`` is true, and a
        discovery cache inside :attr:`workdir`. With ``check``, a non-zero exit raises
        :class:`AssertionError` carrying kubectl's output.
        """
        kubectl = self.kubectl_path or kube_tool("kubectl")
        if kubectl is None:
            raise FileNotFoundError("kubectl not found; call require_kube_tools() first")
        config = self.limited_kubeconfig if limited else self.kubeconfig
        command = [
            str(kubectl),
            f"--kubeconfig={config}",
            f"--cache-dir={self.workdir / 'kubectl-cache'}",
            *args,
        ]
        env = {**os.environ, "KUBECONFIG": str(config)}
        proc = subprocess.run(
            command,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
            )
        return proc

    def get_json(self, path: str, *, token: str | None = None, timeout: float = 10.0) -> Any:
        """GET ``path`` (e.g. ``/openapi/v2``) as the admin user, or with ``token``; return JSON."""
        return json.loads(
            _https_get(self.url + path, self.ca_file, token or self.admin_token, timeout)
        )


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_openssl(openssl: Path, *args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [str(openssl), *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")


_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[serving_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@dataclass(frozen=True)
class _Certs:
    ca: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path


def _make_certs(openssl: Path, cert_dir: Path) -> _Certs:
    """Create a one-off CA, a serving certificate for 127.0.0.1 and a service-account key pair."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    (cert_dir / "openssl.cnf").write_text(_OPENSSL_CONFIG)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    common = ("-config", "openssl.cnf", "-days", "7")
    _run_openssl(
        openssl, "req", "-x509", *ec, *common, "-extensions", "ca_ext",
        "-subj", "/CN=vacancyd-test-ca", "-keyout", "ca.key", "-out", "ca.crt",
        cwd=cert_dir,
    )  # fmt: skip
    _run_openssl(
        openssl, "req", "-new", *ec, "-config", "openssl.cnf",
        "-subj", "/CN=vacancyd-test-apiserver", "-keyout", "serving.key", "-out", "serving.csr",
        cwd=cert_dir,
    )  # fmt: skip
    _run_openssl(
        openssl, "x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", str(secrets.randbits(63)), "-days", "7",
        "-extfile", "openssl.cnf", "-extensions", "serving_ext", "-out", "serving.crt",
        cwd=cert_dir,
    )  # fmt: skip
    _run_openssl(
        openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
        "-out", "sa.key",
        cwd=cert_dir,
    )  # fmt: skip
    _run_openssl(openssl, "pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=cert_dir)
    for key in ("ca.key", "serving.key", "sa.key"):
        (cert_dir / key).chmod(0o600)
    return _Certs(
        ca=cert_dir / "ca.crt",
        serving_cert=cert_dir / "serving.crt",
        serving_key=cert_dir / "serving.key",
        sa_key=cert_dir / "sa.key",
        sa_pub=cert_dir / "sa.pub",
    )


def _write_kubeconfig(path: Path, *, url: str, ca_file: Path, user: str, token: str) -> None:
    """Write a kubeconfig (as JSON, which is valid YAML) using bearer-token auth."""
    ca_data = base64.b64encode(ca_file.read_bytes()).decode("ascii")
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "vacancyd-test",
                "cluster": {"server": url, "certificate-authority-data": ca_data},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": f"{user}@vacancyd-test",
                "context": {"cluster": "vacancyd-test", "user": user, "namespace": "default"},
            }
        ],
        "current-context": f"{user}@vacancyd-test",
        "preferences": {},
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def token_kubeconfig(api: ApiServer, token: str, path: Path, *, user: str = "bearer") -> Path:
    """A kubeconfig at ``path`` that reaches ``api`` as ``user`` with the bearer ``token``
    (a ServiceAccount's, say): only that token's RBAC applies. Returns ``path``."""
    _write_kubeconfig(path, url=api.url, ca_file=api.ca_file, user=user, token=token)
    return path


def _https_get(url: str, ca_file: Path, token: str | None, timeout: float) -> bytes:
    context = ssl.create_default_context(cafile=str(ca_file))
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        body: bytes = response.read()
        return body


def _etcd_healthy(etcd_url: str) -> bool:
    with urllib.request.urlopen(f"{etcd_url}/health", timeout=2) as response:
        return bool(json.loads(response.read()).get("health") == "true")


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-_LOG_TAIL_BYTES:].decode("utf-8", "replace")


def _die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGKILL it when the test process dies.

    Covers a test run that is killed outright (no ``finally`` runs), so that no
    etcd or kube-apiserver is left holding ports and CPU. Best effort: a no-op
    where ``prctl`` is not available.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1


class _Process:
    """A child process with its output in a log file, stopped by :meth:`stop`."""

    def __init__(self, name: str, argv: Sequence[str], log: Path) -> None:
        self.name = name
        self.log = log
        self._log_handle = log.open("wb")
        self.popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def check_alive(self) -> None:
        """Raise :class:`RuntimeError` with the log's tail if the process has exited."""
        code = self.popen.poll()
        if code is not None:
            raise RuntimeError(
                f"{self.name} exited with {code} during startup; log {self.log}:\n"
                f"{_log_tail(self.log)}"
            )

    def stop(self, grace: float = 10.0) -> None:
        """Send SIGTERM, wait up to ``grace`` seconds, then SIGKILL."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=grace)
        self._log_handle.close()


def _wait_until(
    what: str,
    probe: Callable[[], bool],
    processes: Sequence[_Process],
    deadline: float,
) -> None:
    """Call ``probe()`` until it returns true; fail when a process dies or time runs out."""
    last_error = "no attempt"
    while True:
        for process in processes:
            process.check_alive()
        try:
            if probe():
                return
            last_error = "not ready yet"
        except (OSError, urllib.error.URLError, ssl.SSLError, ValueError) as exc:
            last_error = repr(exc)
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.log}:\n{_log_tail(p.log)}" for p in processes)
            raise TimeoutError(f"{what} not ready in time (last: {last_error})\n{logs}")
        time.sleep(0.2)


def etcd_args(etcd_dir: Path, client_port: int, peer_port: int, etcd: Path) -> list[str]:
    """Return etcd's command line: single member, loopback only, data in ``etcd_dir``."""
    client = f"http://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    args = [
        str(etcd),
        "--name=vacancyd-test",
        f"--data-dir={etcd_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=vacancyd-test={peer}",
        "--initial-cluster-state=new",
        "--logger=zap",
        "--log-level=warn",
    ]
    if _etcd_supports_no_fsync(etcd):
        # etcd >= 3.5: skip fsync, as envtest does; test data is thrown away anyway.
        args.append("--unsafe-no-fsync=true")
    return args


_NO_FSYNC_SUPPORT: dict[Path, bool] = {}


def _etcd_supports_no_fsync(etcd: Path) -> bool:
    if etcd not in _NO_FSYNC_SUPPORT:
        proc = subprocess.run(
            [str(etcd), "--help"], capture_output=True, text=True, timeout=30, check=False
        )
        _NO_FSYNC_SUPPORT[etcd] = "--unsafe-no-fsync" in proc.stdout + proc.stderr
    return _NO_FSYNC_SUPPORT[etcd]


def apiserver_args(
    *,
    apiserver: Path,
    port: int,
    etcd_url: str,
    certs: _Certs,
    token_file: Path,
    cert_dir: Path,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Return kube-apiserver's command line (envtest's defaults plus token auth)."""
    return [
        str(apiserver),
        "--advertise-address=127.0.0.1",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={cert_dir}",
        f"--tls-cert-file={certs.serving_cert}",
        f"--tls-private-key-file={certs.serving_key}",
        f"--etcd-servers={etcd_url}",
        f"--token-auth-file={token_file}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer=https://127.0.0.1:{port}/",
        f"--service-account-key-file={certs.sa_pub}",
        f"--service-account-signing-key-file={certs.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # No controller-manager creates the "default" ServiceAccount, so the
        # admission plugin would reject every Pod (envtest disables it too).
        "--disable-admission-plugins=ServiceAccount",
        "--allow-privileged=true",
        # The "kubernetes" Service's endpoint would be 127.0.0.1, which Endpoints
        # validation rejects (loopback); without this the reconciler logs that error
        # every 10 s. The Service itself still exists, with no endpoints.
        "--endpoint-reconciler-type=none",
        "--v=0",
        *extra_args,
    ]


@contextlib.contextmanager
def running_apiserver(
    tmp_path: Path,
    *,
    extra_args: Sequence[str] = (),
    startup_timeout: float = 90.0,
) -> Iterator[ApiServer]:
    """Start etcd and kube-apiserver under ``tmp_path``; yield an :class:`ApiServer`.

    ``extra_args`` are appended to kube-apiserver's command line (a later flag wins).
    Startup (etcd healthy, then ``/readyz`` and the ``default`` namespace) is bounded
    by ``startup_timeout`` seconds. On exit both processes are stopped and the etcd
    data, keys and kubectl cache are removed; the logs stay in ``tmp_path/kube/logs``.
    """
    tools = require_kube_tools(*APISERVER_TOOLS)
    workdir = tmp_path / "kube"
    log_dir = workdir / "logs"
    cert_dir = workdir / "certs"
    etcd_dir = workdir / "etcd"
    log_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + startup_timeout

    certs = _make_certs(tools["openssl"], cert_dir)
    admin_token = secrets.token_urlsafe(24)
    limited_token = secrets.token_urlsafe(24)
    token_file = cert_dir / "tokens.csv"
    token_file.write_text(
        f'{admin_token},{ADMIN_USER},uid-admin,"system:masters"\n'
        f"{limited_token},{LIMITED_USER},uid-limited\n"
    )
    token_file.chmod(0o600)

    processes: list[_Process] = []
    try:
        etcd_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        etcd = _Process(
            "etcd",
            etcd_args(etcd_dir, etcd_port, peer_port, tools["etcd"]),
            log_dir / "etcd.log",
        )
        processes.append(etcd)
        _wait_until(
            "etcd",
            lambda: _etcd_healthy(etcd_url),
            processes,
            deadline,
        )

        port = free_port()
        url = f"https://127.0.0.1:{port}"
        apiserver = _Process(
            "kube-apiserver",
            apiserver_args(
                apiserver=tools["kube-apiserver"],
                port=port,
                etcd_url=etcd_url,
                certs=certs,
                token_file=token_file,
                cert_dir=cert_dir,
                extra_args=extra_args,
            ),
            log_dir / "kube-apiserver.log",
        )
        processes.append(apiserver)

        def ready() -> bool:
            try:
                body = _https_get(f"{url}/readyz", certs.ca, admin_token, 5)
            except urllib.error.HTTPError as exc:
                if exc.code in (500, 503):  # starting: some checks still fail
                    return False
                raise
            return body.strip() == b"ok"

        def default_namespace() -> bool:
            _https_get(f"{url}/api/v1/namespaces/default", certs.ca, admin_token, 5)
            return True

        _wait_until("kube-apiserver /readyz", ready, processes, deadline)
        # The bootstrap controller creates "default" shortly after; wait for it so
        # that namespaced objects can be created at once.
        _wait_until("namespace default", default_namespace, processes, deadline)

        kubeconfig = workdir / "kubeconfig"
        limited_kubeconfig = workdir / "kubeconfig-limited"
        _write_kubeconfig(kubeconfig, url=url, ca_file=certs.ca, user=ADMIN_USER, token=admin_token)
        _write_kubeconfig(
            limited_kubeconfig,
            url=url,
            ca_file=certs.ca,
            user=LIMITED_USER,
            token=limited_token,
        )
        yield ApiServer(
            url=url,
            kubeconfig=kubeconfig,
            limited_kubeconfig=limited_kubeconfig,
            admin_token=admin_token,
            limited_token=limited_token,
            ca_file=certs.ca,
            etcd_url=etcd_url,
            workdir=workdir,
            kubectl_path=kube_tool("kubectl"),
        )
    finally:
        # API server first, so that it does not log etcd connection errors.
        for process in reversed(processes):
            process.stop()
        shutil.rmtree(etcd_dir, ignore_errors=True)
        shutil.rmtree(workdir / "kubectl-cache", ignore_errors=True)
        for secret in ("ca.key", "serving.key", "sa.key", "tokens.csv"):
            (cert_dir / secret).unlink(missing_ok=True)


# --- kubeconform schemas -------------------------------------------------------------

_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"


def _kind_file_name(kind: str, group: str, version: str) -> str:
    """Name a schema file the way kubeconform's ``{{ .ResourceKind }}{{ .KindSuffix }}`` does."""
    suffix = f"-{group.split('.')[0]}-{version}" if group else f"-{version}"
    return f"{kind}{suffix}.json".lower()


def _convert_schema(node: Any, *, ref_target: str, strict: bool, nullable: bool) -> Any:
    """Turn an OpenAPI v2 schema fragment into a JSON-schema (draft 4) fragment."""
    if isinstance(node, list):
        return [
            _convert_schema(item, ref_target=ref_target, strict=strict, nullable=False)
            for item in node
        ]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return {"$ref": f"{ref_target}#/definitions/{name}"}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {
                prop: _convert_schema(sub, ref_target=ref_target, strict=strict, nullable=True)
                for prop, sub in value.items()
            }
        elif key in ("items", "additionalProperties", "allOf", "anyOf", "oneOf", "not"):
            out[key] = _convert_schema(value, ref_target=ref_target, strict=strict, nullable=False)
        else:
            out[key] = value
    if out.get("format") == "int-or-string":
        out.pop("type", None)
        out.pop("format", None)
        out["oneOf"] = [{"type": "string"}, {"type": "integer"}]
    if nullable and isinstance(out.get("type"), str):
        # Generated manifests carry e.g. `creationTimestamp: null`; the server accepts it.
        out["type"] = [out["type"], "null"]
    if strict and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def write_kubeconform_schemas(api: ApiServer, dest: Path) -> str:
    """Write kubeconform schemas for every kind the server serves; return a -schema-location.

    The schemas are generated from the server's ``/openapi/v2``, so kubeconform runs
    with no network: pass the returned template as ``-schema-location``. Two trees are
    written, ``dest/schemas`` and ``dest/schemas-strict`` (objects reject unknown
    fields), picked by kubeconform's ``-strict`` flag through ``{{ .StrictSuffix }}``.
    """
    spec = api.get_json("/openapi/v2", timeout=60)
    definitions: dict[str, Any] = spec["definitions"]
    for strict in (False, True):
        out_dir = dest / ("schemas-strict" if strict else "schemas")
        out_dir.mkdir(parents=True, exist_ok=True)
        converted: dict[str, Any] = {}
        for name, schema in definitions.items():
            if name in (_QUANTITY, _INT_OR_STRING):
                # Written as 2, "2" or "500m" (quantities) and 80 or "http" (ports).
                number = "number" if name == _QUANTITY else "integer"
                converted[name] = {
                    "description": schema.get("description", ""),
                    "oneOf": [{"type": "string"}, {"type": number}, {"type": "null"}],
                }
            else:
                # Scalar definitions (Time, MicroTime) may be null, as properties may.
                scalar = schema.get("type") not in (None, "object")
                converted[name] = _convert_schema(
                    schema, ref_target="", strict=strict, nullable=scalar
                )
        (out_dir / "_definitions.json").write_text(json.dumps({"definitions": converted}))
        for schema in definitions.values():
            for gvk in schema.get("x-kubernetes-group-version-kind", []):
                kind_schema = _convert_schema(
                    schema, ref_target="_definitions.json", strict=strict, nullable=False
                )
                kind_schema["$schema"] = "http://json-schema.org/draft-04/schema#"
                file_name = _kind_file_name(gvk["kind"], gvk.get("group", ""), gvk["version"])
                (out_dir / file_name).write_text(json.dumps(kind_schema))
    return str(dest / "schemas{{ .StrictSuffix }}" / "{{ .ResourceKind }}{{ .KindSuffix }}.json")


# --- Helm hook Jobs -------------------------------------------------------------------


@dataclass
class HookRun:
    """One hook Job :func:`running_hook_jobs` ran: its name, argv and exit code."""

    job: str
    args: list[str]
    returncode: int
    output: str


def service_account_kubeconfig(api: ApiServer, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig with a fresh token of ``namespace/account``: only its RBAC applies."""
    token = api.kubectl("-n", namespace, "create", "token", account, "--duration=1h").stdout
    ca = base64.b64encode(api.ca_file.read_bytes()).decode("ascii")
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": api.url, "certificate-authority-data": ca}}
                ],
                "users": [{"name": "sa", "user": {"token": token.strip()}}],
                "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa"}}],
                "current-context": "sa",
            }
        )
    )
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def running_hook_jobs(api: ApiServer, namespace: str, workdir: Path) -> Iterator[list[HookRun]]:
    """Play kube-controller-manager and kubelet for vacancyd's Helm hook Jobs (neither runs
    here), so that ``helm uninstall`` can wait for its pre-delete hook.

    A thread polls ``namespace`` for Jobs annotated ``helm.sh/hook``; for each it runs the
    container's args as ``python -m vacancyd ARGS --kubeconfig=...`` with a token of the
    Job's own ServiceAccount (so only the chart's RBAC applies), against this API server,
    then deletes the Job: Helm's wait for a hook Job ends when the Job completes or is
    deleted. Yields the list of runs, filled as they happen.
    """
    import sys
    import threading

    runs: list[HookRun] = []
    stop = threading.Event()
    root = Path(__file__).resolve().parents[2]

    def once() -> None:
        proc = api.kubectl("-n", namespace, "get", "jobs", "-o", "json", check=False)
        if proc.returncode:
            return
        for job in json.loads(proc.stdout)["items"]:
            meta = job["metadata"]
            if "helm.sh/hook" not in (meta.get("annotations") or {}):
                continue
            pod = job["spec"]["template"]["spec"]
            args = list(pod["containers"][0]["args"])
            config = service_account_kubeconfig(
                api, namespace, pod["serviceAccountName"], workdir / f"{meta['name']}.kubeconfig"
            )
            ran = subprocess.run(
                [sys.executable, "-m", "vacancyd", *args, f"--kubeconfig={config}"],
                capture_output=True, text=True, timeout=120, check=False, cwd=root,
            )  # fmt: skip
            runs.append(HookRun(meta["name"], args, ran.returncode, ran.stdout + ran.stderr))
            api.kubectl("-n", namespace, "delete", "job", meta["name"], "--wait=false", check=False)

    def loop() -> None:
        while not stop.wait(0.3):
            once()

    thread = threading.Thread(target=loop, name="hook jobs", daemon=True)
    thread.start()
    try:
        yield runs
    finally:
        stop.set()
        thread.join(timeout=150)
