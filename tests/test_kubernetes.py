"""deploy/kubernetes/, rendered and checked offline: every overlay renders with
``kubectl kustomize``; every manifest passes schema validation (Kubernetes'
own kinds with ``kubernetes-validate`` for :data:`KUBERNETES`, the MPIJob and the
ServiceMonitor against their operators' CRD schemas kept in deploy/kubernetes/schemas/,
all strict: an unknown field fails); the images and commands are docker/'s; the servers'
command line parses with ``ps_server``'s own parser for every pod; ``HVD_COMPRESS_PS``
parses with the client's parser and names exactly the StatefulSet's pods; the scale
knobs reach every place that depends on them. Docs: docs/deployment/kubernetes.md.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.harness import ROOT

pytestmark = [
    pytest.mark.multiprocess,  # runs kubectl, and bash for make-secrets.sh
    pytest.mark.skipif(shutil.which("kubectl") is None,
                       reason="kubectl is not installed (it renders the overlays: "
                       "kubectl kustomize, v1.14 or later)"),
]

KUBE = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "docker"
KUBERNETES = "1.32.0"
"""The Kubernetes version the built-in kinds are validated against (the oldest with the
StatefulSet pod-index label GA, which the servers' shard index comes from)."""
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
CRD_SCHEMAS = {("kubeflow.org/v2beta1", "MPIJob"): "mpijob-v2beta1.json",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json"}
VERSION = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
MPIRUN_OPTIONS = {"-np": 1, "--bind-to": 1, "--map-by": 1, "-wdir": 1, "-mca": 2, "-x": 1}
"""The mpirun options the launcher may use, with their number of values."""

Manifest = dict[str, Any]


def render(directory: Path) -> list[Manifest]:
    """The manifests ``kubectl kustomize directory`` prints."""
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@cache
def rendered(overlay: str) -> tuple[Manifest, ...]:
    return tuple(render(KUBE / "overlays" / overlay))


def one(manifests: list[Manifest] | tuple[Manifest, ...], kind: str) -> Manifest:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _strict(schema: Any) -> Any:
    """``schema`` where an object with listed properties refuses others, as the API server
    does with strict field validation (``kubectl apply``'s default)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(name: str) -> jsonschema.Draft7Validator:
    schema = json.loads((KUBE / "schemas" / name).read_text())
    return jsonschema.Draft7Validator(_strict(schema))


def validate(manifest: Manifest) -> None:
    """Raise ``jsonschema.ValidationError`` when ``manifest`` is not valid: a custom
    resource against its CRD schema (and an MPIJob's pod templates against Kubernetes'
    own PodTemplate as well), anything else with kubernetes-validate, strict."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key not in CRD_SCHEMAS:
        kubernetes_validate.validate(manifest, KUBERNETES, strict=True)
        return
    crd_validator(CRD_SCHEMAS[key]).validate(manifest)
    if manifest["kind"] == "MPIJob":
        for role, spec in manifest["spec"]["mpiReplicaSpecs"].items():
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()},
                 "template": spec["template"]}, KUBERNETES, strict=True)


# --- reading the manifests --------------------------------------------------------------

def container(pod_spec: Manifest, name: str) -> Manifest:
    (found,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return found


def roles(job: Manifest) -> tuple[Manifest, Manifest]:
    """The launcher's and the worker's (pod spec, container)."""
    specs = job["spec"]["mpiReplicaSpecs"]
    launcher = specs["Launcher"]["template"]["spec"]
    worker = specs["Worker"]["template"]["spec"]
    return launcher, worker


def split_mpirun(args: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """mpirun's arguments -> ([(option, values)], the program's command line)."""
    options, i = [], 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] not in MPIRUN_OPTIONS:
            raise ValueError(f"mpirun option {args[i]!r} is not one of {list(MPIRUN_OPTIONS)}")
        n = MPIRUN_OPTIONS[args[i]]
        options.append((args[i], args[i + 1:i + 1 + n]))
        i += 1 + n
    return options, args[i:]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a container's args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def pod_env(spec: Manifest, pod: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet makes it, in order, for a pod whose
    ``metadata.namespace`` and ``metadata.labels[...]`` are ``pod``'s entries (secret
    references become ``<secret NAME KEY>``)."""
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = pod[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = f"<secret {ref['name']} {ref['key']}>"
    return env


def scale(manifests: list[Manifest] | tuple[Manifest, ...]) -> dict[str, int]:
    """The counts as deployed: shards, worker pods, slots per worker, ranks (mpirun -np)."""
    job = one(manifests, "MPIJob")
    options, _ = split_mpirun(container(roles(job)[0], "launcher")["args"])
    return {"shards": one(manifests, "StatefulSet")["spec"]["replicas"],
            "workers": job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"],
            "slots": job["spec"]["slotsPerWorker"],
            "ranks": int(dict(options)["-np"][0])}


def namespace(manifests: list[Manifest] | tuple[Manifest, ...]) -> str:
    return one(manifests, "StatefulSet")["metadata"].get("namespace", "default")


def ps_addresses(manifests: list[Manifest] | tuple[Manifest, ...], ns: str
                 ) -> tuple[list[str], bool]:
    """What the launcher's HVD_COMPRESS_PS says in namespace ``ns``, through the client's
    own parser: (["host:port", ...], TLS)."""
    from hvd_compress.comm.ps_client import parse_addresses

    launcher = container(roles(one(manifests, "MPIJob"))[0], "launcher")
    env = pod_env(launcher, {"metadata.namespace": ns})
    return parse_addresses(env["HVD_COMPRESS_PS"], "HVD_COMPRESS_PS")


def server_argv(manifests: list[Manifest] | tuple[Manifest, ...], index: int,
                files: dict[str, Path]) -> tuple[list[str], dict[str, str]]:
    """Server pod ``ps-index``'s command line and HVD_PS_* environment, with the paths of
    its mounted Secrets' files replaced by the local copies in ``files`` (mount path ->
    directory holding the Secret's keys as files)."""
    sts = one(manifests, "StatefulSet")
    spec = container(sts["spec"]["template"]["spec"], "ps")
    label = "metadata.labels['apps.kubernetes.io/pod-index']"
    env = pod_env(spec, {label: str(index), "metadata.namespace": namespace(manifests)})

    def local(text: str) -> str:
        for mount, directory in files.items():
            text = text.replace(mount + "/", f"{directory}/")
        return text

    argv = [local(expand(arg, env)) for arg in spec["args"]]
    return argv, {k: local(v) for k, v in env.items() if k.startswith("HVD_PS_")}


def secret_mounts(manifests: list[Manifest] | tuple[Manifest, ...], secrets: dict[str, Path]
                  ) -> dict[str, Path]:
    """The server container's Secret mounts: mount path -> the local directory holding that
    Secret's keys (``secrets``: Secret name -> directory), only the keys the volume lists."""
    pod = one(manifests, "StatefulSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for mount in container(pod, "ps").get("volumeMounts", []):
        source = volumes.get(mount["name"], {}).get("secret")
        if source is not None:
            assert source["secretName"] in secrets, f"no such Secret {source['secretName']}"
            out[mount["mountPath"]] = secrets[source["secretName"]]
    return out


def consistency_problems(manifests: list[Manifest] | tuple[Manifest, ...]) -> list[str]:
    """What does not fit together in one overlay's manifests (empty when all does): the
    counts, the servers' addresses, ports and names, TLS on both sides."""
    problems = []
    n = scale(manifests)
    sts = one(manifests, "StatefulSet")
    job = one(manifests, "MPIJob")
    if n["ranks"] != n["workers"] * n["slots"]:
        problems.append(f"mpirun -np {n['ranks']} != {n['workers']} workers x "
                        f"{n['slots']} slots")
    ps = container(sts["spec"]["template"]["spec"], "ps")
    args = " ".join(ps["args"])
    if f"--workers={n['ranks']}" not in ps["args"]:
        problems.append(f"the servers' --workers is not the {n['ranks']} ranks: {args}")
    if f"--shard=$(PS_SHARD_INDEX)/{n['shards']}" not in ps["args"]:
        problems.append(f"the servers' --shard is not I/{n['shards']}: {args}")
    service = [m for m in manifests if m["kind"] == "Service"
               and m["metadata"]["name"] == sts["spec"]["serviceName"]]
    if not service or service[0]["spec"].get("clusterIP") != "None":
        problems.append(f"no headless Service {sts['spec']['serviceName']!r}")
        return problems
    ports = {p["name"]: p["port"] for p in service[0]["spec"]["ports"]}
    ns = namespace(manifests)
    want = [f"ps-{i}.{sts['spec']['serviceName']}.{ns}.svc:{ports['grpc']}"
            for i in range(n["shards"])]
    addresses, tls = ps_addresses(manifests, ns)
    if addresses != want:
        problems.append(f"HVD_COMPRESS_PS names {addresses}, the StatefulSet's pods are {want}")
    serves_tls = any(e["name"] == "HVD_PS_TLS_CERT" for e in ps.get("env", []))
    if tls != serves_tls:
        problems.append(f"the workers use {'grpcs' if tls else 'grpc'}:// but the servers "
                        f"{'serve' if serves_tls else 'do not serve'} TLS")
    worker = roles(job)[1]
    gpus = container(worker, "worker").get("resources", {}).get("limits", {})
    if "nvidia.com/gpu" in gpus and int(gpus["nvidia.com/gpu"]) != n["slots"]:
        problems.append(f"{gpus['nvidia.com/gpu']} GPUs per worker for {n['slots']} slots")
    return problems


# --- the tests --------------------------------------------------------------------------

def test_the_overlays_are_cpu_gpu_and_production():
    assert OVERLAYS == ["cpu", "gpu", "production"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_validates(overlay: str):
    manifests = rendered(overlay)
    kinds = sorted(m["kind"] for m in manifests)
    expected = ["MPIJob", "Service", "StatefulSet"]
    assert kinds == sorted(expected + ["ServiceMonitor"] * (overlay == "production"))
    for manifest in manifests:
        validate(manifest)


def _broken(manifests: tuple[Manifest, ...], kind: str, path: str, value: Any) -> Manifest:
    """A copy of the ``kind`` manifest with ``value`` at ``path`` (dots; digits index)."""
    manifest = copy.deepcopy(one(manifests, kind))
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = manifest
    for part in parents:
        node = node[part]
    node[last] = value
    return manifest


@pytest.mark.parametrize("kind, path, value", [
    ("StatefulSet", "spec.replicas", "two"),
    ("StatefulSet", "spec.template.spec.containers.0.readinessProbe.periodSeconds", "5s"),
    ("StatefulSet", "spec.template.spec.containers.0.imagePullPolicy_", "Always"),
    ("Service", "spec.ports.0.port", "7070"),
    ("MPIJob", "spec.slotsPerWorker", "1"),
    ("MPIJob", "spec.mpiImplementation", "LAM"),
    ("MPIJob", "spec.sshAuthMountPth", "/home/worker/.ssh"),
    ("MPIJob", "spec.runPolicy.cleanPodPolicy", ["Running"]),
    ("MPIJob", "spec.mpiReplicaSpecs.Worker.template.spec.containers.0.imge", "x"),
    ("MPIJob", "spec.mpiReplicaSpecs.Worker.template.spec.containers.0.ports.0.containerPort",
     "ssh"),
    ("ServiceMonitor", "spec.endpoints.0.interval", 30),
    ("ServiceMonitor", "spec.endpoints.0.prot", "metrics"),
])
def test_a_broken_manifest_fails_validation(kind: str, path: str, value: Any):
    manifest = _broken(rendered("production"), kind, path, value)
    with pytest.raises(jsonschema.ValidationError):
        validate(manifest)


def _compose() -> Manifest:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _dockerfile(name: str) -> str:
    return (DOCKER / f"Dockerfile.{name}").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_and_commands_are_dockers(overlay: str):
    manifests = rendered(overlay)
    compose = _compose()["services"]
    sts = one(manifests, "StatefulSet")
    ps = container(sts["spec"]["template"]["spec"], "ps")
    assert ps["image"] == compose["ps"]["image"] == f"hvd-compress/server:{VERSION}"
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.*)$", _dockerfile("server"), re.M)[1])
    assert ps["command"] == entrypoint

    variant = "cpu" if overlay == "cpu" else "gpu"
    launcher, worker = roles(one(manifests, "MPIJob"))
    for spec, name in ((launcher, "launcher"), (worker, "worker")):
        assert container(spec, name)["image"] == f"hvd-compress/{variant}:{VERSION}"
        assert spec["securityContext"]["runAsUser"] == 10001
    assert compose["worker0"]["image"] == f"hvd-compress/cpu:{VERSION}"
    dockerfile = _dockerfile(variant)
    assert "USER 10001" in dockerfile

    # The launcher runs compose's training command (servers from HVD_COMPRESS_PS instead
    # of --ps), in the image's checkout, on every rank.
    run = container(launcher, "launcher")
    assert run["command"] == ["mpirun"]
    options, program = split_mpirun(run["args"])
    compose_cmd = shlex.split(compose["worker0"]["command"][-1].split(" -- ", 1)[1])
    ps_at = compose_cmd.index("--ps")
    assert program == compose_cmd[:ps_at] + compose_cmd[ps_at + 2:]
    workdir = re.search(r"^WORKDIR (.*)$", dockerfile, re.M)[1]
    assert dict(options)["-wdir"] == [workdir] and (ROOT / program[1]).is_file()
    forwarded = {values[0] for option, values in options if option == "-x"}
    defined = {e["name"] for e in run["env"]} | {"PATH", "OMP_NUM_THREADS"}
    assert {"PATH", "HVD_COMPRESS_PS", "HVD_COMPRESS_PS_TOKEN"} <= forwarded <= defined
    assert re.search(r"^ENV PATH=/opt/hvd/bin:\$PATH OMP_NUM_THREADS=1", dockerfile, re.M)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_run_the_images_sshd_as_the_operator_expects(overlay: str):
    job = one(rendered(overlay), "MPIJob")
    launcher, worker = roles(job)
    sshd = container(worker, "worker")
    assert sshd["command"] == ["/usr/sbin/sshd"] and sshd["args"][:2] == ["-De", "-f"]
    # The config is the checkout's, which the image copies to its WORKDIR.
    dockerfile = _dockerfile("cpu" if overlay == "cpu" else "gpu")
    workdir = re.search(r"^WORKDIR (.*)$", dockerfile, re.M)[1]
    assert "COPY . /opt/hvd-compress" in dockerfile and "openssh-server" in dockerfile
    config_path = Path(sshd["args"][2])
    config = dict(line.split(None, 1) for line in
                  (ROOT / config_path.relative_to(workdir)).read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    home = re.search(r"--home-dir (\S+) worker", dockerfile)[1]
    mount = job["spec"]["sshAuthMountPath"]
    assert mount == f"{home}/.ssh"
    assert config["HostKey"] == f"{mount}/id_rsa" and config["UsePAM"] == "no"
    options, _ = split_mpirun(container(launcher, "launcher")["args"])
    rsh = " ".join(v[1] for o, v in options if o == "-mca" and v[0] == "plm_rsh_args")
    port = int(config["Port"])
    assert f"-p {port}" in rsh and "ConnectionAttempts" in rsh
    assert sshd["readinessProbe"]["tcpSocket"]["port"] == port > 1024  # not root
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in ("Running", "All")
    assert "resources" not in container(launcher, "launcher") or "nvidia.com/gpu" not in \
        container(launcher, "launcher")["resources"].get("limits", {})


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Secrets ``make-secrets.sh --print`` makes for namespace ``default``, validated,
    written out as files (Secret name -> directory of its keys)."""
    result = subprocess.run(["bash", str(KUBE / "make-secrets.sh"), "default", "--print"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = {}
    for secret in (d for d in yaml.safe_load_all(result.stdout) if d):
        secret["metadata"].pop("creationTimestamp", None)
        validate(secret)
        directory = tmp_path_factory.mktemp(secret["metadata"]["name"])
        for key, value in secret["data"].items():
            (directory / key).write_bytes(base64.b64decode(value))
        out[secret["metadata"]["name"]] = directory
    assert sorted(out) == ["hvd-ps-tls", "hvd-ps-token"]
    return out


def test_make_secrets_certificate_names_the_server_pods(secrets: dict[str, Path]):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                           str(secrets["hvd-ps-tls"] / "tls.crt")], capture_output=True,
                          text=True, timeout=60, check=True).stdout
    # The wildcard covers one label: ps-I of ps-I.ps.default.svc, as the workers dial it.
    assert "DNS:*.ps.default.svc" in text and "DNS:localhost" in text
    assert len((secrets["hvd-ps-token"] / "token").read_text().strip()) == 64


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_server_command_line_parses_for_every_pod(overlay: str, secrets: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch):
    from ps_server.__main__ import ENV_PREFIX, parse_args

    manifests = rendered(overlay)
    n = scale(manifests)
    sts = one(manifests, "StatefulSet")
    pod = sts["spec"]["template"]
    spec = container(pod["spec"], "ps")
    ports = {p["name"]: p["containerPort"] for p in spec["ports"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    files = secret_mounts(manifests, secrets)
    for index in range(n["shards"]):
        argv, env = server_argv(manifests, index, files)
        for name in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        args = parse_args(argv)
        assert args.shard == (index, n["shards"]) and args.workers == n["ranks"]
        assert args.bind == ("0.0.0.0", ports["grpc"])
        assert args.checkpoint_dir == mounts[claim["metadata"]["name"]]
        assert args.metrics_port == ports["metrics"] == int(
            pod["metadata"]["annotations"]["prometheus.io/port"])
        assert args.token_file is not None
        assert (args.tls_cert is not None) == (overlay == "production")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = spec[probe]
        if "grpc" in check:  # the kubelet's own gRPC client: plaintext only
            assert overlay != "production"
            assert check["grpc"] == {"port": ports["grpc"],
                                     "service": "hvd_compress.ps.ParameterServer"}
        else:  # TLS: the image's health check, which speaks it
            assert check["exec"]["command"] == ["python3", "-m", "ps_server.healthcheck",
                                                f"127.0.0.1:{ports['grpc']}"]


def test_a_wrong_server_command_line_is_refused(secrets: dict[str, Path]):
    from ps_server.__main__ import parse_args

    manifests = rendered("cpu")
    argv, _ = server_argv(manifests, 0, secret_mounts(manifests, secrets))
    with pytest.raises(SystemExit):
        parse_args([a.replace("--shard=0/", "--shard=2/") for a in argv])
    missing = secret_mounts(manifests, {"hvd-ps-token": Path("/nonexistent")})
    with pytest.raises(SystemExit):
        parse_args(server_argv(manifests, 0, missing)[0])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_fits_together(overlay: str):
    manifests = rendered(overlay)
    assert consistency_problems(manifests) == []
    addresses, _ = ps_addresses(manifests, "team-a")  # any namespace the job runs in
    assert addresses == [f"ps-{i}.ps.team-a.svc:7070" for i in range(scale(manifests)["shards"])]


def _copy_deploy(tmp_path: Path) -> Path:
    shutil.copytree(KUBE, tmp_path / "kubernetes", ignore=shutil.ignore_patterns("schemas"))
    return tmp_path / "kubernetes"


def _set_scale(tree: Path, overlay: str, **data: str) -> None:
    path = tree / "overlays" / overlay / "scale.yaml"
    text = path.read_text()
    for key, value in data.items():
        text, count = re.subn(rf"^(  {key}: ).*$", rf"\g<1>{value}", text, flags=re.M)
        assert count == 1, key
    path.write_text(text)


@pytest.mark.parametrize("overlay", ["gpu", "production"])
def test_the_scale_reaches_every_manifest(overlay: str, tmp_path: Path):
    tree = _copy_deploy(tmp_path)
    scheme = "grpcs" if overlay == "production" else "grpc"
    addresses = ",".join(f"{scheme}://ps-{i}.ps.$(POD_NAMESPACE).svc:7070" for i in range(3))
    _set_scale(tree, overlay, shards='"3"', workers='"4"', slotsPerWorker='"2"',
               ranks='"8"', psAddresses=addresses)
    manifests = render(tree / "overlays" / overlay)
    assert scale(manifests) == {"shards": 3, "workers": 4, "slots": 2, "ranks": 8}
    assert consistency_problems(manifests) == []
    worker = container(roles(one(manifests, "MPIJob"))[1], "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    for manifest in manifests:
        validate(manifest)


@pytest.mark.parametrize("data, problem", [
    ({"ranks": '"3"'}, "mpirun -np 3 != 2 workers x 1 slots"),
    ({"shards": '"3"'}, "HVD_COMPRESS_PS names"),
    ({"psAddresses": "grpc://ps-1.ps.$(POD_NAMESPACE).svc:7070,"
                     "grpc://ps-0.ps.$(POD_NAMESPACE).svc:7070"}, "HVD_COMPRESS_PS names"),
    ({"psAddresses": "grpcs://ps-0.ps.$(POD_NAMESPACE).svc:7070,"
                     "grpcs://ps-1.ps.$(POD_NAMESPACE).svc:7070"}, "serve TLS"),
])
def test_an_inconsistent_scale_is_caught(data: dict[str, str], problem: str, tmp_path: Path):
    tree = _copy_deploy(tmp_path)
    _set_scale(tree, "cpu", **data)
    problems = consistency_problems(render(tree / "overlays" / "cpu"))
    assert any(problem in p for p in problems), problems
