"""deploy/k8s, deploy/container and deploy/systemd: every file parses, and the pieces agree with
each other (ports, names, labels, probes, hardening)."""

import re
import shutil
import subprocess
import sys

import pytest
import yaml

import metrics_contract as mc

DEPLOY = mc.REPO / "deploy"
K8S = DEPLOY / "k8s"
GRPC_PORT, METRICS_PORT = 50051, 9464


def all_yaml():
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml"))


@pytest.mark.parametrize("path", all_yaml(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no document"


@pytest.fixture(scope="module")
def objects():
    out = {}
    for path in K8S.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "kind" in doc and doc["kind"] != "Kustomization":
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def test_kustomization_lists_existing_files():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for r in k["resources"]:
        assert (K8S / r).is_file(), r
    # The Secret is created by hand (never a committed token); PodMonitor is the alternative to
    # the ServiceMonitor, and applying both would scrape every daemon twice.
    assert "secret.yaml" not in k["resources"] and "podmonitor.yaml" not in k["resources"]


def test_every_object_is_namespaced_and_labelled(objects):
    for (kind, name), o in objects.items():
        if kind in ("Namespace", "Kustomization"):
            continue
        assert o["metadata"]["namespace"] == "kvpack", (kind, name)
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvpack", (kind, name)


def container(objects):
    return objects[("DaemonSet", "kvpackd")]["spec"]["template"]["spec"]["containers"][0]


def test_daemonset_holds_one_gpu_with_grpc_probes(objects):
    ds = objects[("DaemonSet", "kvpackd")]
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= \
        ds["spec"]["template"]["metadata"]["labels"].items()
    c = container(objects)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == GRPC_PORT, probe
    assert spec["terminationGracePeriodSeconds"] >= 60, "SIGTERM drains in-flight layers"


def test_daemonset_runs_unprivileged(objects):
    spec = objects[("DaemonSet", "kvpackd")]["spec"]["template"]["spec"]
    c = container(objects)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert spec["automountServiceAccountToken"] is False


def test_flags_token_and_volumes_agree(objects):
    c = container(objects)
    spec = objects[("DaemonSet", "kvpackd")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    cm_name = c["envFrom"][0]["configMapRef"]["name"]
    env = objects[("ConfigMap", cm_name)]["data"]
    # Every $(VAR) in args is a ConfigMap key, and every key is used.
    used = set(re.findall(r"\$\((\w+)\)", " ".join(c["args"])))
    assert used == set(env), (used, set(env))
    args = " ".join(c["args"]).replace("$(", "{").replace(")", "}").format(**env)
    assert f"--listen=0.0.0.0:{GRPC_PORT}" in args
    assert f"--metrics_address=0.0.0.0:{METRICS_PORT}" in args
    assert int(env["KVPACKD_DRAIN_SECONDS"]) < spec["terminationGracePeriodSeconds"]
    secret = objects[("Secret", volumes["auth"]["secret"]["secretName"])]
    assert f"--auth_token_file={mounts['auth']}/token" in args, \
        "listening beyond loopback requires the bearer token"
    assert len(secret["stringData"]["token"]) < 16, \
        "the committed placeholder must be too short for the daemon to accept"


def test_service_is_node_local_and_matches_ports(objects):
    svc = objects[("Service", "kvpackd")]
    ds = objects[("DaemonSet", "kvpackd")]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    names = {p["name"] for p in container(objects)["ports"]}
    for p in svc["spec"]["ports"]:
        assert p["targetPort"] in names


def test_monitors_scrape_the_metrics_port_as_job_kvpackd(objects):
    svc = objects[("Service", "kvpackd")]
    sm = objects[("ServiceMonitor", "kvpackd")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "kvpackd"
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    pm = objects[("PodMonitor", "kvpackd")]
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert ep["port"] == "metrics"
    assert {"targetLabel": "job", "replacement": "kvpackd"} in ep["relabelings"]


def test_prometheusrule_is_in_sync_with_the_rules_file():
    r = subprocess.run([sys.executable, str(DEPLOY / "prometheus" / "to_prometheusrule.py"),
                        "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ── container ───────────────────────────────────────────────────────────────────────────────────

def test_dockerfile_is_multistage_unprivileged_with_grpc_healthcheck():
    text = (DEPLOY / "container" / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) >= 2
    assert "-devel-" in froms[0] and "-runtime-" in froms[-1]
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and not users[-1].startswith(("0", "root"))
    health = re.search(r"^HEALTHCHECK\s.*CMD\s+(.*)$", text, re.M)
    assert health and "grpc_health_probe" in health.group(1)
    assert f"-addr=127.0.0.1:{GRPC_PORT}" in health.group(1)
    assert re.search(rf"^EXPOSE\s+{GRPC_PORT}\s+{METRICS_PORT}", text, re.M)
    assert "--auth_token_file=" in text and '"--listen=0.0.0.0:50051"' in text


# ── systemd ─────────────────────────────────────────────────────────────────────────────────────

def unit_settings(path):
    settings = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            settings.setdefault(m.group(1), []).append(m.group(2))
    return settings


def test_systemd_unit_hardening():
    s = unit_settings(DEPLOY / "systemd" / "kvpackd.service")
    want = {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
            "PrivateTmp": "yes", "DevicePolicy": "closed", "MemoryDenyWriteExecute": "yes",
            "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "KillSignal": "SIGTERM"}
    for key, value in want.items():
        assert s.get(key) == [value], key
    assert "User" in s or s.get("DynamicUser") == ["yes"]
    assert any("nvidia" in d for d in s["DeviceAllow"])
    assert s["EnvironmentFile"] == ["/etc/kvpack/kvpackd.env"]
    assert "$KVPACKD_FLAGS" in s["ExecStart"][0]
    env = (DEPLOY / "systemd" / "kvpackd.env").read_text()
    flags = re.search(r'^KVPACKD_FLAGS="(.*)"$', env, re.M).group(1).split()
    assert f"--metrics_address=127.0.0.1:{METRICS_PORT}" in flags
    assert "--listen=unix:/run/kvpackd/kvpackd.sock" in flags, "the socket in RuntimeDirectory"
    drain = next(float(f.split("=")[1]) for f in flags if f.startswith("--drain_seconds="))
    stop = unit_settings(DEPLOY / "systemd" / "kvpackd.service")["TimeoutStopSec"][0]
    assert drain < float(stop), "the daemon drains before systemd kills it"


def test_template_unit_has_the_same_hardening():
    """kvpackd@.service differs from kvpackd.service only where an instance must."""
    one = unit_settings(DEPLOY / "systemd" / "kvpackd.service")
    per_gpu = unit_settings(DEPLOY / "systemd" / "kvpackd@.service")
    differ = {k for k in one.keys() | per_gpu.keys() if one.get(k) != per_gpu.get(k)}
    assert differ == {"Description", "EnvironmentFile", "Environment", "RuntimeDirectory",
                      "StateDirectory"}, differ
    assert per_gpu["Environment"] == ["CUDA_VISIBLE_DEVICES=%i"]
    assert per_gpu["RuntimeDirectory"] == ["kvpackd/%i"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name,instance", [("kvpackd.service", "kvpackd.service"),
                                           ("kvpackd@.service", "kvpackd@0.service")])
def test_systemd_unit_verifies(tmp_path, name, instance):
    """systemd-analyze knows every directive; the exposure score stays low. ExecStart points at
    /bin/true because verify checks that the binary exists."""
    unit = tmp_path / name
    unit.write_text((DEPLOY / "systemd" / name).read_text()
                    .replace("/usr/local/bin/kvpackd", "/bin/true"))
    target = str(tmp_path / instance)
    r = subprocess.run(["systemd-analyze", "verify", target], capture_output=True, text=True)
    assert r.returncode == 0 and "kvpackd" not in r.stderr, r.stderr
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=25", target],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomization_builds():
    """kubectl kustomize (offline) renders the kustomization into the objects it lists."""
    r = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(r.stdout) if d)
    assert kinds == sorted(["Namespace", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor",
                            "PrometheusRule"])


def test_frontend_example_points_at_the_daemon(objects):
    doc = yaml.safe_load((K8S / "examples" / "frontend.yaml").read_text())
    spec = doc["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    svc = objects[("Service", "kvpackd")]
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert env["KVPACK_TARGET"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}" \
                                   f".svc:{grpc_port}"
    secret = next(v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v)
    assert (("Secret", secret)) in objects
    mount = spec["containers"][0]["volumeMounts"][0]["mountPath"]
    assert env["KVPACK_TOKEN_FILE"] == f"{mount}/token"
    ds_nodes = objects[("DaemonSet", "kvpackd")]["spec"]["template"]["spec"]["nodeSelector"]
    assert spec["nodeSelector"] == ds_nodes, "frontends only where a daemon runs"
