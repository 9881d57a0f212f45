"""deploy/: every file parses and holds the hardening the checklist asks for;
systemd's own checks accept the unit where systemd-analyze is installed."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from rendezvousd import config as config_mod
from rendezvousd.cli.sdnotify import Notifier
from rendezvousd.cli.serve import build_parser
from rendezvousd.errors import ConfigError
from rendezvousd.server import auth
from tests.deploy.deploy_tree import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    ENV_EXAMPLE,
    KUBE,
    PORT,
    UNIT,
    _as_argv,
    _exec_form,
    _subparsers,
    arg_value,
    argv_invocations,
    dockerfile_instructions,
    kube_docs,
    launcher_args,
    parse_unit,
    serve_args,
    serve_config,
    systemd_seconds,
    text_invocations,
)

# ---------------------------------------------------------------------------
# 1. Every file parses; the required keys and hardening are there.
# ---------------------------------------------------------------------------


def test_the_deploy_tree_has_the_expected_files() -> None:
    for rel in (
        "systemd/rendezvousd.service",
        "systemd/rendezvousd.env.example",
        "container/Dockerfile",
        "container/compose.yaml",
        "kubernetes/secret.example.yaml",
        "kubernetes/statefulset.yaml",
        "kubernetes/service.yaml",
        "kubernetes/worker-job.yaml",
        "kubernetes/worker-job-spares.yaml",
    ):
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("*.y*ml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_yaml_file_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)
    if path.parent == KUBE:
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"], path
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], path
                assert "namespace" not in doc["metadata"], (
                    f"{path.name}: keep it namespace-agnostic"
                )


def test_systemd_unit_is_type_notify_with_watchdog_and_hardening() -> None:
    unit = parse_unit(UNIT.read_text())
    svc = unit["Service"]

    def one(key: str) -> str:
        assert key in svc, f"[Service] lacks {key}="
        return svc[key][-1]  # the last assignment wins

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert one("Restart") == "on-failure"
    for key in (
        "NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "LockPersonality",
        "RestrictRealtime", "RestrictNamespaces", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
        "MemoryDenyWriteExecute",
    ):  # fmt: skip
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"
    assert one("UMask") == "0077"
    assert one("StateDirectory") == "rendezvousd"
    dynamic = svc.get("DynamicUser", ["no"])[-1] == "yes"
    assert dynamic or svc.get("User", [""])[-1] not in ("", "root", "0"), "run unprivileged"
    # No capabilities at all: both sets end up empty.
    assert one("CapabilityBoundingSet") == ""
    assert one("AmbientCapabilities") == ""
    assert set(one("RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in one("SystemCallFilter").split()
    assert "/etc/default/rendezvousd" in one("EnvironmentFile")

    # The daemon pings at half of WATCHDOG_USEC, well inside WatchdogSec.
    watchdog = systemd_seconds(one("WatchdogSec"))
    notifier = Notifier.from_env({"WATCHDOG_USEC": str(int(watchdog * 1_000_000))})
    assert notifier.watchdog_interval is not None and 0 < notifier.watchdog_interval < watchdog

    # The token comes in as a credential, the state dir from StateDirectory=.
    assert any(c.startswith("token:/") for c in svc["LoadCredential"])
    exec_start = shlex.split(one("ExecStart"))
    assert arg_value(exec_start, "--token-file") == "${CREDENTIALS_DIRECTORY}/token"
    assert arg_value(exec_start, "--state-dir") in ("${STATE_DIRECTORY}", "/var/lib/rendezvousd")
    assert arg_value(exec_start, "--listen") is not None

    # What ExecStart runs with is a configuration the daemon accepts, and the
    # stop timeout leaves room for the whole drain.
    env = dict(item.split("=", 1) for line in svc["Environment"] for item in shlex.split(line))
    env |= {
        "CREDENTIALS_DIRECTORY": "/run/credentials/rendezvousd.service",
        "STATE_DIRECTORY": "/var/lib/rendezvousd",
    }
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in exec_start]
    assert argv[:3] == ["/usr/bin/env", "rendezvousd", "serve"]
    cfg = serve_config(argv[3:], env={k: v for k, v in env.items() if k.startswith("RENDEZVOUSD_")})
    assert cfg.token_file == Path("/run/credentials/rendezvousd.service/token")
    assert systemd_seconds(one("TimeoutStopSec")) > cfg.drain_grace_s + 5


def test_env_example_values_are_accepted_and_defaults_are_current() -> None:
    assignments = dict(
        re.findall(r"^#?(RENDEZVOUSD_[A-Z0-9_]+)=(\S*)$", ENV_EXAMPLE.read_text(), re.M)
    )
    fields = {config_mod.ENV_PREFIX + n.upper(): f for n, f in config_mod.FIELDS.items()}
    assert set(assignments) <= set(fields), "only daemon settings belong in the env file"
    assert "RENDEZVOUSD_TOKEN" not in assignments
    config_mod.load(None, env=assignments)  # every value has the right type and passes checks
    for var, value in assignments.items():
        default = fields[var].default
        if isinstance(default, bool):
            assert value.lower() == str(default).lower(), f"{var}: default is {default}"
        elif isinstance(default, int | float):
            assert float(value) == default, f"{var}: shown as {value}, default is {default}"


def test_dockerfile_is_non_root_with_a_health_check_and_an_accepted_default_command() -> None:
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    keywords = [i.keyword for i in ins]
    assert ins[keywords.index("FROM")].rest.startswith("python:3.11-slim")
    final_stage = ins[len(keywords) - 1 - keywords[::-1].index("FROM") :]
    assert final_stage[0].rest.startswith("python:3.11-slim")
    assert any("pip install --no-cache-dir" in i.rest and i.rest.endswith(" .") for i in ins)

    users = [i.rest for i in final_stage if i.keyword == "USER"]
    assert users, "the final stage must drop root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, non-zero: runAsNonRoot can verify it"

    assert str(PORT) in " ".join(i.rest for i in final_stage if i.keyword == "EXPOSE").split()
    health = [i.rest for i in final_stage if i.keyword == "HEALTHCHECK"]
    assert len(health) == 1
    subcommands = frozenset(_subparsers(build_parser()))
    checks = text_invocations(health[0], subcommands)
    assert checks and all(c.command == "rendezvousd health" for c in checks)
    assert all(arg_value(c.args, "--endpoint") == f"127.0.0.1:{PORT}" for c in checks)

    entrypoint = _exec_form(next(i.rest for i in final_stage if i.keyword == "ENTRYPOINT"))
    cmd = _exec_form(next(i.rest for i in final_stage if i.keyword == "CMD"))
    assert entrypoint == ["rendezvousd"]
    assert cmd[0] == "serve"
    cfg = serve_config(cmd[1:])
    assert cfg.listen == f"0.0.0.0:{PORT}"
    assert cfg.tls_cert is not None or cfg.insecure_plaintext, "refused otherwise"
    assert cfg.tls_cert is not None, "the image's default is TLS; plaintext is an explicit opt-in"
    # The only writable places: the state dir (created for uid 10001) and /tmp.
    assert cfg.state_dir == Path("/var/lib/rendezvousd")
    assert any("/var/lib/rendezvousd" in i.rest for i in final_stage if i.keyword == "VOLUME")
    assert any(f"-o {uid}" in i.rest and "/var/lib/rendezvousd" in i.rest for i in final_stage)
    assert cfg.token_file is not None and str(cfg.token_file).startswith("/run/secrets/")


def test_compose_runs_read_only_non_root_and_waits_for_a_healthy_daemon() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, Any] = doc["services"]
    assert {"rendezvousd", "node0", "node1"} <= set(services)
    subcommands = frozenset(_subparsers(build_parser()))
    for name, svc in services.items():
        assert svc["read_only"] is True, name
        assert any(str(t).split(":")[0] == "/tmp" for t in svc["tmpfs"]), name
        assert int(str(svc["user"]).split(":")[0]) != 0, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name

    server = services["rendezvousd"]
    (args,) = serve_args(argv_invocations(_as_argv(server["command"]), subcommands))
    cfg = serve_config(args)
    secret = doc["secrets"]["rendezvousd_token"]
    assert "file" in secret
    assert cfg.token_file == Path("/run/secrets/rendezvousd_token")
    assert "rendezvousd_token" in server["secrets"]
    assert cfg.state_dir is not None
    assert any(str(v).endswith(f":{cfg.state_dir}") for v in server["volumes"])
    if cfg.insecure_plaintext:  # documented: only on an internal network, nothing published
        assert "ports" not in server
        assert all(doc["networks"][n]["internal"] is True for n in server["networks"])
    test = server["healthcheck"]["test"]
    (check,) = argv_invocations([str(t) for t in test[1:]], subcommands)
    assert check.command == "rendezvousd health"
    assert arg_value(check.args, "--endpoint") == f"127.0.0.1:{PORT}"

    for rank, name in enumerate(("node0", "node1")):
        node = services[name]
        assert node["depends_on"]["rendezvousd"]["condition"] == "service_healthy"
        argv = [*_as_argv(node.get("entrypoint")), *_as_argv(node.get("command"))]
        assert argv[0] == "rendezvous-run"
        assert arg_value(argv, "--node-rank") == str(rank)
        assert arg_value(argv, "--nnodes") == "2"
        assert arg_value(argv, "--rdzv-endpoint") == f"rendezvousd:{PORT}"
        assert arg_value(argv, "-m") == "rendezvousd.trainer.example"
        assert node["environment"]["RENDEZVOUSD_TOKEN_FILE"] == str(cfg.token_file)
        parsed = launcher_args(argv, {})
        if parsed is not None:
            # --nnodes is kept as written: N or the elastic MIN:MAX.
            assert (parsed.nnodes, parsed.node_rank, parsed.nproc_per_node) == ("2", rank, 2)
            assert (parsed.module, parsed.target, parsed.backend) == (
                True,
                "rendezvousd.trainer.example",
                "cpu",
            )
        assert "rendezvousd_token" in node["secrets"]


def _containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _assert_hardened(pod: Mapping[str, Any]) -> None:
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    for c in _containers(pod):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc.get("runAsNonRoot", psc["runAsNonRoot"]) is True, c["name"]
        assert sc.get("seccompProfile", psc["seccompProfile"])["type"] == "RuntimeDefault"


def _mount_for(container: Mapping[str, Any], path: str) -> dict[str, Any]:
    mounts = [
        m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"nothing mounted at {path}"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def _env(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_kubernetes_daemon_is_hardened_probed_over_grpc_and_reads_a_private_token() -> None:
    docs = kube_docs()
    (sts,) = docs["StatefulSet"]
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    _assert_hardened(pod)
    (container,) = pod["containers"]
    argv = [*_as_argv(container.get("command")), *_as_argv(container.get("args"))]
    (args,) = serve_args(argv_invocations(argv, frozenset(_subparsers(build_parser()))))
    cfg = serve_config(args)
    assert cfg.listen.endswith(f":{PORT}")
    assert pod["terminationGracePeriodSeconds"] > cfg.drain_grace_s
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == PORT, probe

    # The token file the daemon reads must be 0600/0400 and group-unreadable.
    assert cfg.token_file is not None
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_volume = volumes[_mount_for(container, str(cfg.token_file))["name"]]
    secrets = [v for v in pod["volumes"] if "secret" in v]
    assert secrets and all(v["secret"]["defaultMode"] in (0o400, 0o600) for v in secrets)
    if "secret" in token_volume:
        # The kubelet adds group-read to Secret files when fsGroup is set.
        assert "fsGroup" not in pod["securityContext"]
    else:
        # A private copy: an init container installs the Secret's file at 0600.
        assert token_volume["emptyDir"]["medium"] == "Memory"
        installers = [
            c
            for c in pod.get("initContainers", [])
            if any(m["name"] == token_volume["name"] for m in c["volumeMounts"])
        ]
        assert installers, "who writes the token copy?"
        command = [*installers[0]["command"], *installers[0].get("args", [])]
        assert arg_value(command, "-m") in ("0600", "0400", "600", "400")
        assert any(volumes[m["name"]].get("secret") for m in installers[0]["volumeMounts"])

    (svc,) = docs["Service"]
    assert svc["spec"]["type"] == "ClusterIP"
    selector = svc["spec"]["selector"]
    assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert (grpc_port["port"], grpc_port["appProtocol"]) == (PORT, "grpc")

    (policy,) = docs["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= selector.items()

    (secret,) = docs["Secret"]
    with pytest.raises(ConfigError):  # the placeholder fails closed if applied as is
        auth.validate_tokens(secret["stringData"]["token"].splitlines(), "example")

    (kustomization,) = docs["Kustomization"]
    assert all((KUBE / r).is_file() for r in kustomization["resources"])
    assert "secret.example.yaml" not in kustomization["resources"]


def _job(docs: Mapping[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    (job,) = [j for j in docs["Job"] if j["metadata"]["name"] == name]
    return job


def test_kubernetes_worker_job_takes_its_node_rank_from_the_completion_index() -> None:
    docs = kube_docs()
    job = _job(docs, "rendezvous-train-example")
    (svc,) = docs["Service"]
    (policy,) = docs["NetworkPolicy"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    _assert_hardened(pod)
    (worker,) = pod["containers"]
    argv = [*_as_argv(worker.get("command")), *_as_argv(worker.get("args"))]
    assert argv[0] == "rendezvous-run"
    env = _env(worker)
    field_path = env["RENDEZVOUSD_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert "batch.kubernetes.io/job-completion-index" in field_path
    # The launcher takes the rank as a flag; the kubelet expands $(VAR) into it.
    assert arg_value(argv, "--node-rank") == "$(RENDEZVOUSD_NODE_RANK)"
    assert int(arg_value(argv, "--nnodes") or 0) == spec["completions"] == spec["parallelism"]
    parsed = launcher_args(argv, {"RENDEZVOUSD_NODE_RANK": "1"})
    if parsed is not None:
        assert (parsed.nnodes, parsed.node_rank) == (str(spec["completions"]), 1)
        assert (parsed.module, parsed.target) == (True, "rendezvousd.trainer.example")
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert env["RENDEZVOUSD_ENDPOINT"]["value"] == f"{svc['metadata']['name']}:{grpc_port['port']}"
    token_mount = _mount_for(worker, env["RENDEZVOUSD_TOKEN_FILE"]["value"])
    volume = next(v for v in pod["volumes"] if v["name"] == token_mount["name"])
    assert volume["secret"]["secretName"] == docs["Secret"][0]["metadata"]["name"]
    allowed = [
        peer["podSelector"]["matchLabels"]
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == PORT for p in rule["ports"])
        for peer in rule["from"]
    ]
    labels = spec["template"]["metadata"]["labels"]
    assert any(sel.items() <= labels.items() for sel in allowed), "the policy would block it"


def test_kubernetes_spares_job_runs_one_command_whose_extra_pods_stand_by() -> None:
    """Every pod the same command: --node-rank auto and --standby-if-full, more pods
    than --nnodes (the spares), replacements allowed, and a valid launcher config."""
    docs = kube_docs()
    spec = _job(docs, "rendezvous-train-spares-example")["spec"]
    assert spec.get("completionMode", "NonIndexed") == "NonIndexed"
    pod = spec["template"]["spec"]
    _assert_hardened(pod)
    # podFailurePolicy needs it; a failed pod is replaced by a new pod, not restarted.
    assert pod["restartPolicy"] == "Never"
    (worker,) = pod["containers"]
    argv = [*_as_argv(worker.get("command")), *_as_argv(worker.get("args"))]
    assert argv[0] == "rendezvous-run"
    assert arg_value(argv, "--node-rank") == "auto" and "--standby-if-full" in argv
    nnodes = int(arg_value(argv, "--nnodes") or 0)
    assert spec["completions"] == spec["parallelism"] > nnodes >= 2
    # A pod lost with its node is replaced (and becomes the new spare).
    assert spec["backoffLimit"] >= 1
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule["action"] == "Ignore" and rule["onPodConditions"] == [{"type": "DisruptionTarget"}]
    env = _env(worker)
    assert "RENDEZVOUSD_NODE_RANK" not in env
    assert "controller-uid" in env["RENDEZVOUSD_JOB_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    parsed = launcher_args(argv, {})
    if parsed is not None:
        from rendezvousd.trainer.agent.launcher import resolve

        plain = {name: str(var["value"]) for name, var in env.items() if "value" in var}
        config = resolve(
            parsed, {**plain, "RENDEZVOUSD_JOB_ID": "uid", "RENDEZVOUSD_RING_HOST": "198.18.0.1"}
        )
        assert config.standby_if_full and not config.standby
        assert (config.num_nodes, config.node_rank) == (nnodes, None)


def _launcher_argvs() -> list[tuple[str, list[str], dict[str, Any]]]:
    """Every rendezvous-run command line in the manifests and compose, with the name of
    what runs it and its environment."""
    found: list[tuple[str, list[str], dict[str, Any]]] = []
    for job in kube_docs().get("Job", []):
        for c in job["spec"]["template"]["spec"]["containers"]:
            argv = [*_as_argv(c.get("command")), *_as_argv(c.get("args"))]
            env = {n: e.get("value") for n, e in _env(c).items()}
            found.append((job["metadata"]["name"], argv, env))
    for name, svc in yaml.safe_load(COMPOSE.read_text())["services"].items():
        argv = [*_as_argv(svc.get("entrypoint")), *_as_argv(svc.get("command"))]
        found.append((name, argv, dict(svc.get("environment") or {})))
    return [(name, argv, env) for name, argv, env in found if argv[:1] == ["rendezvous-run"]]


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def test_worker_manifests_with_spares_can_restart_when_a_node_is_lost() -> None:
    """A spare takes a lost node's place in a new generation, and the surviving nodes
    count that failure against their --max-restarts: at the default 0 they give up at
    the first lost node, and the spare only ever exits "not needed"."""
    checked = 0
    for name, argv, env in _launcher_argvs():
        spares = (
            "--standby" in argv
            or "--standby-if-full" in argv
            or _truthy(env.get("RENDEZVOUSD_STANDBY"))
            or _truthy(env.get("RENDEZVOUSD_STANDBY_IF_FULL"))
        )
        if not spares:
            continue
        checked += 1
        restarts = arg_value(argv, "--max-restarts") or env.get("RENDEZVOUSD_MAX_RESTARTS")
        assert restarts is not None and int(restarts) >= 1, (
            f"{name}: has spares but no --max-restarts (0): the survivors give up at the "
            "first lost node"
        )
    assert checked, "the spares example is no longer found"
    # Its comments: backoffLimit counts the node losses the Job outlives; each one costs
    # the survivors a restart.
    spec = _job(kube_docs(), "rendezvous-train-spares-example")["spec"]
    (worker,) = spec["template"]["spec"]["containers"]
    argv = [*_as_argv(worker.get("command")), *_as_argv(worker.get("args"))]
    assert int(arg_value(argv, "--max-restarts") or 0) >= spec["backoffLimit"]


def test_kubernetes_state_dir_is_a_directory_below_the_fsgroup_volume_root() -> None:
    """With fsGroup the kubelet makes a volume's root group-owned, group-writable and
    setgid (2770), and does so again at any mount that finds it otherwise, so a chmod
    does not last; the daemon refuses a state dir group or others can write. It creates
    a subdirectory itself (0700), which the kubelet leaves alone only under
    OnRootMismatch (Always would chmod it 2770 at every mount)."""
    (sts,) = kube_docs()["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = [*_as_argv(container.get("command")), *_as_argv(container.get("args"))]
    (args,) = serve_args(argv_invocations(argv, frozenset(_subparsers(build_parser()))))
    cfg = serve_config(args)
    assert cfg.state_dir is not None
    state = PurePosixPath(cfg.state_dir)
    mounts = [
        m
        for m in container["volumeMounts"]
        if state == PurePosixPath(m["mountPath"]) or PurePosixPath(m["mountPath"]) in state.parents
    ]
    assert mounts, f"nothing mounted at {state}: the state would not survive the pod"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims, "the state must live on the PersistentVolume"
    if "fsGroup" in pod["securityContext"]:
        assert state != PurePosixPath(mount["mountPath"]), (
            f"--state-dir {state} is the root of a volume mounted with fsGroup (made 2770 "
            "by the kubelet), which the daemon refuses: use a subdirectory"
        )
        assert pod["securityContext"].get("fsGroupChangePolicy") == "OnRootMismatch"


def test_the_other_deploy_files_give_the_daemon_a_state_dir_only_it_can_write() -> None:
    """systemd and the image make the state dir 0700 themselves (a named volume starts
    as a copy of the image's directory, mode and owner included)."""
    service = parse_unit(UNIT.read_text())["Service"]
    assert not int(service["StateDirectoryMode"][-1], 8) & 0o022
    assert "--state-dir ${STATE_DIRECTORY}" in service["ExecStart"][-1]
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    cmd = _exec_form(next(i.rest for i in reversed(ins) if i.keyword == "CMD"))
    state = arg_value(cmd, "--state-dir")
    assert any(
        i.keyword == "RUN" and re.search(rf"install -d -m 0?700 .*{re.escape(str(state))}", i.rest)
        for i in ins
    )
    doc = yaml.safe_load(COMPOSE.read_text())
    server = doc["services"]["rendezvousd"]
    assert arg_value(_as_argv(server["command"]), "--state-dir") == state
    (volume,) = [str(v) for v in server["volumes"] if str(v).endswith(f":{state}")]
    assert volume.split(":")[0] in doc["volumes"], "a named volume, seeded from the image"


def test_shipped_trainer_configs_point_at_the_daemons_default_port() -> None:
    """A config run as shipped (docs/trainer.md's smoke run) reaches a daemon started
    with its defaults."""
    import tomllib

    checked = 0
    for path in sorted((DEPLOY.parent / "trainer" / "configs").glob("*.toml")):
        rendezvous = tomllib.loads(path.read_text()).get("distributed", {}).get("rendezvous", {})
        endpoint = rendezvous.get("endpoint")
        if rendezvous.get("kind") == "daemon" and endpoint:
            checked += 1
            assert endpoint.rsplit(":", 1)[1] == str(PORT), f"{path.name}: {endpoint}"
    assert checked, "no shipped config names a daemon endpoint any more"


# ---------------------------------------------------------------------------
# 3. systemd's own checks, where systemd-analyze is installed.
# ---------------------------------------------------------------------------

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit() -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (result.stdout + result.stderr).strip()
    ours = [line for line in output.splitlines() if UNIT.name in line]
    if result.returncode != 0 and not ours:
        pytest.skip(f"systemd-analyze cannot run here: {output[:300]}")
    # Unknown keys and bad values are only warnings (exit 0): fail on any line.
    assert ours == [] and result.returncode == 0, output


@needs_systemd_analyze
def test_systemd_analyze_security_rates_the_unit_ok() -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    if match is None:
        pytest.skip(f"systemd-analyze security --offline unsupported: {result.stderr[:300]}")
    assert float(match.group(1)) <= 2.0, result.stdout[-2000:]


def test_the_unit_reloads_the_token_file_with_sighup() -> None:
    """`systemctl reload rendezvousd` sends the main process SIGHUP: the daemon reads
    its token file again (tests/daemon/test_token_reload.py)."""
    service = parse_unit(UNIT.read_text())["Service"]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
