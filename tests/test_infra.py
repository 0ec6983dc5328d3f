"""infra/: the work-pool job templates on a real Prefect server, their rendering, prefect.yaml, triggers.

- every template is accepted by `prefect work-pool create` and reads back unchanged;
- Prefect's own job-configuration rendering turns the TPU job variables into the GKE node
  selectors and `google.com/tpu` requests/limits (and defaults alone render a valid job);
- `prefect deploy --all --prefect-file infra/prefect.yaml` succeeds against pools made from the
  templates, and each deployment sits on the pool its template is meant for;
- the server enforces the TPU variables' schema on flow runs, and the registry's per-stage job
  variables fit it;
- a GCS object-finalize notification, mapped by infra/gcs-webhook-template.jinja and posted to
  the events API, starts generate-batch (only under prompts/), and the decode-rerun trigger
  matches first attempts of decode stages only.
"""
import ast
import asyncio
import base64
import copy
import datetime
import json
import re
import subprocess
import time
import urllib.request
import uuid

import jsonschema
import pytest
import yaml

from tests.prefect_env import BIN, REPO

INFRA = REPO / "infra"
TPU, CPU, VERTEX = "k8s-tpu-job-template.json", "k8s-cpu-job-template.json", "vertex-tpu-job-template.json"
# pool -> (worker type, template): what infra/README.md tells an operator to create
POOLS = {
    "vidax-tpu-large": ("kubernetes", TPU),
    "vidax-tpu-small": ("kubernetes", TPU),
    "vidax-cpu": ("kubernetes", CPU),
    "vidax-tpu-vertex": ("vertex-ai", VERTEX),
}
TPU_VARS = {"tpu_accelerator": "tpu-v5p-slice", "tpu_topology": "2x2x4", "tpu_chips": 4, "tpu_hosts": 4,
            "image": "us-docker.pkg.dev/p/vidax/vidax:test"}
SELECTOR_ACC, SELECTOR_TOPO = "cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"


def _template(name: str) -> dict:
    return json.loads((INFRA / name).read_text())


def _prefect_yaml() -> dict:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


def _run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------ rendering (Prefect's worker code path)
def _config_classes():
    from prefect.workers.base import BaseJobConfiguration

    class K8sJobConfig(BaseJobConfiguration):  # the fields prefect-kubernetes' configuration declares
        namespace: str = "default"
        job_manifest: dict
        cluster_config: dict | None = None
        job_watch_timeout_seconds: int | None = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True

    class VertexJobConfig(BaseJobConfiguration):  # likewise for prefect-gcp's Vertex AI worker
        region: str
        credentials: dict | None = None
        job_spec: dict
        job_watch_poll_interval: float = 5.0

    return K8sJobConfig, VertexJobConfig


def render(name: str, values: dict):
    """The job configuration a worker builds from this template and these job variables
    (BaseJobConfiguration.from_template_and_values: schema defaults, then apply_values)."""
    from prefect import get_client

    k8s, vertex = _config_classes()
    cls = vertex if name == VERTEX else k8s

    async def go():
        async with get_client() as c:
            return await cls.from_template_and_values(_template(name), values, client=c)

    return _run(go())


def _missing_paths(obj, required, path=""):
    """Paths of `required` absent from (or different in) `obj`: the worker's own manifest check
    (prefect-kubernetes / prefect-gcp reject a job lacking these)."""
    out = []
    if isinstance(required, dict):
        for k, v in required.items():
            if not isinstance(obj, dict) or k not in obj:
                out.append(f"{path}/{k}")
            else:
                out += _missing_paths(obj[k], v, f"{path}/{k}")
    elif isinstance(required, list):
        for i, v in enumerate(required):
            if not isinstance(obj, list) or i >= len(obj):
                out.append(f"{path}/{i}")
            else:
                out += _missing_paths(obj[i], v, f"{path}/{i}")
    elif required is not ... and obj != required:
        out.append(f"{path} must be {required!r}")
    return out


K8S_REQUIRED = {"apiVersion": "batch/v1", "kind": "Job", "spec": {"template": {"spec": {
    "parallelism": 1, "completions": 1, "restartPolicy": "Never", "containers": [{"name": "prefect-job"}]}}}}
VERTEX_REQUIRED = {"maximum_run_time_hours": ..., "worker_pool_specs": [{
    "replica_count": ..., "container_spec": {"image_uri": ...}, "machine_spec": {"machine_type": ...},
    "disk_spec": {"boot_disk_type": ..., "boot_disk_size_gb": ...}}]}


def _pod(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]


def test_tpu_template_renders_selectors_and_chip_limits(prefect_server):
    cfg = render(TPU, TPU_VARS)
    m = cfg.job_manifest
    assert not _missing_paths(m, K8S_REQUIRED)
    pod = _pod(m)
    assert pod["nodeSelector"] == {SELECTOR_ACC: "tpu-v5p-slice", SELECTOR_TOPO: "2x2x4"}
    c = pod["containers"][0]
    assert c["resources"]["limits"]["google.com/tpu"] == 4
    assert c["resources"]["requests"]["google.com/tpu"] == 4
    assert c["image"] == TPU_VARS["image"]
    # one pod per host of the slice, each with its completion index
    assert (m["spec"]["parallelism"], m["spec"]["completions"], m["spec"]["completionMode"]) == (4, 4, "Indexed")
    assert pod["subdomain"] == "vidax-tpu"
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # optional settings left unset vanish instead of rendering empty values
    assert "cloud.google.com/gke-spot" not in pod["nodeSelector"]
    assert "activeDeadlineSeconds" not in m["spec"] and "cpu" not in c["resources"]["limits"]

    assert pod["volumes"] == [] and c["volumeMounts"] == []

    weights = {"name": "weights", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": True,
                                          "volumeAttributes": {"bucketName": "my-weights"}}}
    more = render(TPU, {**TPU_VARS, "spot": "true", "active_deadline_seconds": 7200, "cpu_limit": "16",
                        "volumes": [weights], "volume_mounts": [{"name": "weights", "mountPath": "/weights"}],
                        "pod_annotations": {"gke-gcsfuse/volumes": "true"}})
    mm = more.job_manifest
    assert _pod(mm)["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert mm["spec"]["activeDeadlineSeconds"] == 7200
    assert _pod(mm)["containers"][0]["resources"]["limits"]["cpu"] == "16"
    assert _pod(mm)["volumes"] == [weights]
    assert _pod(mm)["containers"][0]["volumeMounts"] == [{"name": "weights", "mountPath": "/weights"}]
    assert mm["spec"]["template"]["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}


def test_templates_defaults_render_valid_jobs(prefect_server):
    for name in (TPU, CPU, VERTEX):
        props = _template(name)["variables"]["properties"]
        for var, schema in props.items():  # every default satisfies its own schema
            if "default" in schema:
                jsonschema.validate(schema["default"], {k: v for k, v in schema.items() if k != "default"})

    tpu = render(TPU, {})
    m = tpu.job_manifest
    assert not _missing_paths(m, K8S_REQUIRED)
    pod = _pod(m)
    assert pod["nodeSelector"] == {SELECTOR_ACC: "tpu-v5-lite-podslice", SELECTOR_TOPO: "2x2"}
    res = pod["containers"][0]["resources"]
    assert res["limits"] == {"google.com/tpu": 4} and res["requests"]["google.com/tpu"] == 4
    assert (m["spec"]["parallelism"], m["spec"]["completions"]) == (1, 1)
    assert m["metadata"]["namespace"] == tpu.namespace == "vidax"
    assert tpu.pod_watch_timeout_seconds >= 600  # TPU node pools scale up from zero slowly
    assert "image" not in pod["containers"][0]  # no default image: the worker fills in Prefect's, README says set one
    _assert_no_placeholders(m)

    cpu = render(CPU, {"image": "img:1"})
    cm = cpu.job_manifest
    assert not _missing_paths(cm, K8S_REQUIRED)
    assert "nodeSelector" not in _pod(cm)
    assert "google.com/tpu" not in json.dumps(cm)
    assert _pod(cm)["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "4Gi"}
    _assert_no_placeholders(cm)

    vx = render(VERTEX, {"region": "us-central1", "image": "img:1"})
    assert not _missing_paths(vx.job_spec, VERTEX_REQUIRED)
    ms = vx.job_spec["worker_pool_specs"][0]["machine_spec"]
    assert ms == {"machine_type": "ct5lp-hightpu-4t", "tpu_topology": "2x2"}  # no accelerator fields for ct5lp
    assert "scheduling" not in vx.job_spec
    _assert_no_placeholders(vx.job_spec)


def _assert_no_placeholders(obj):
    assert "{{" not in json.dumps(obj), json.dumps(obj, indent=1)


def test_vertex_template_renders_tpu_machine(prefect_server):
    vx = render(VERTEX, {"region": "us-central1", "image": "img:1", "machine_type": "ct5lp-hightpu-8t",
                         "tpu_topology": "2x4", "scheduling": {"strategy": "SPOT"}, "maximum_run_time_hours": 12})
    spec = vx.job_spec
    assert spec["worker_pool_specs"][0]["machine_spec"] == {"machine_type": "ct5lp-hightpu-8t", "tpu_topology": "2x4"}
    assert spec["worker_pool_specs"][0]["container_spec"]["image_uri"] == "img:1"
    assert spec["scheduling"] == {"strategy": "SPOT"} and spec["maximum_run_time_hours"] == 12
    legacy = render(VERTEX, {"region": "r", "image": "i", "machine_type": "cloud-tpu", "accelerator_type": "TPU_V3",
                             "accelerator_count": 8})
    assert legacy.job_spec["worker_pool_specs"][0]["machine_spec"]["accelerator_type"] == "TPU_V3"


# ------------------------------------------------------------------ registry job variables vs the TPU schema
def _registry_cases():
    from vidax import registry

    for r in registry.MODELS.values():
        for preset, kinds in r.stage_jobs.items():
            for kind, jv in kinds.items():
                yield r.model_id, preset, kind, jv


@pytest.mark.parametrize("model,preset,kind,jv", [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{case[2]}") for case in _registry_cases()])
def test_registry_stage_job_variables_fit_the_tpu_template(model, preset, kind, jv):
    schema = _template(TPU)["variables"]
    undeclared = set(jv) - set(schema["properties"])
    assert not undeclared, f"job variables the TPU template does not declare: {undeclared}"
    jsonschema.validate(jv, {"type": "object", "properties": schema["properties"]})
    chips = jv.get("tpu_chips", schema["properties"]["tpu_chips"]["default"])
    hosts = jv.get("tpu_hosts", schema["properties"]["tpu_hosts"]["default"])
    topo = jv.get("tpu_topology", schema["properties"]["tpu_topology"]["default"])
    slice_chips = 1
    for d in topo.split("x"):
        slice_chips *= int(d)
    assert chips * hosts == slice_chips, f"{topo} has {slice_chips} chips; {hosts} host(s) x {chips} chips do not cover it"


# ------------------------------------------------------------------ prefect.yaml, Dockerfile, README (no server)
def _flow_names() -> dict:
    """function name -> @flow(name=...) in flows/flows.py, read without importing it."""
    tree = ast.parse((REPO / "flows/flows.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "flow":
                    for kw in d.keywords:
                        if kw.arg == "name":
                            out[node.name] = kw.value.value
    return out


def test_prefect_yaml_deployments_use_the_templated_pools():
    from vidax import registry

    cfg = _prefect_yaml()
    deps = {d["name"]: d for d in cfg["deployments"]}
    pools = {n: d["work_pool"]["name"] for n, d in deps.items()}
    assert set(pools.values()) <= set(POOLS), f"deployments on pools with no template: {set(pools.values()) - set(POOLS)}"
    # the TPU pools run the TPU template; orchestration and mux run on CPU
    assert pools["sample"] == "vidax-tpu-large"
    assert pools["encode"] == pools["decode"] == "vidax-tpu-small"
    for kind in ("encode", "sample", "decode", "mux"):  # a batch's phases run where their single stages do
        assert pools[f"batch-{kind}"] == pools[kind]
    assert pools["mux"] == pools["generate"] == pools["generate-batch"] == "vidax-cpu"
    assert POOLS["vidax-tpu-large"][1] == POOLS["vidax-tpu-small"][1] == TPU and POOLS["vidax-cpu"][1] == CPU
    # every stage kind the flows route with run_deployment has its deployment, for the flow it names
    names = _flow_names()
    for kind, full in [*registry.STAGE_DEPLOYMENTS.items(), *registry.PHASE_DEPLOYMENTS.items()]:
        flow_name, dep_name = full.split("/")
        assert dep_name in deps, f"registry routes {kind} to {full}, which prefect.yaml does not declare"
        module, func = deps[dep_name]["entrypoint"].split(":")
        assert module == "flows.flows" and names[func] == flow_name
    for d in deps.values():  # entrypoints resolve to flows in flows/flows.py
        assert d["entrypoint"].split(":")[1] in names
    assert cfg["prefect-version"] == _dockerfile_arg("PREFECT_VERSION")


def _dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S*)$", (INFRA / "Dockerfile").read_text(), re.M)
    assert m, f"infra/Dockerfile declares no ARG {name}"
    return m.group(1)


def test_dockerfile_installs_vidax_with_the_tpu_extra():
    import tomllib

    text = (INFRA / "Dockerfile").read_text()
    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    extra = _dockerfile_arg("VIDAX_EXTRA")
    assert extra == "tpu" and any(d.startswith("jax[tpu]") for d in py["project"]["optional-dependencies"][extra])
    assert re.search(r'pip install "\.\$\{VIDAX_EXTRA:\+\[\$VIDAX_EXTRA\]\}" "prefect==\$\{PREFECT_VERSION\}"', text)
    assert re.search(r"^WORKDIR /opt/vidax$", text, re.M)
    for pkg in py["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert re.search(rf"^COPY {pkg.rstrip('*')} ", text, re.M), f"Dockerfile does not copy {pkg}"
    # no credentials in the image
    assert not re.search(r"^(ENV|ARG)\s.*(KEY|TOKEN|SECRET|PASSWORD|CREDENTIALS)", text, re.M | re.I)
    assert "PREFECT_API_KEY=" not in text and "GOOGLE_APPLICATION_CREDENTIALS" not in text


def test_readme_names_only_existing_infra_files():
    text = (INFRA / "README.md").read_text()
    named = set(re.findall(r"infra/([\w.-]+\.(?:json|yaml|jinja|md)|Dockerfile)\b", text))
    assert {TPU, CPU, VERTEX, "prefect.yaml", "Dockerfile", "gcs-webhook-template.jinja"} <= named
    assert all((INFRA / f).exists() for f in named), named


# ------------------------------------------------------------------ against the real server
def _cli_parallel(srv, *commands, timeout=180):
    """Run several `prefect ...` CLI commands at once (each CLI start costs seconds)."""
    procs = [subprocess.Popen([str(BIN / "prefect"), *c], env=srv.env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]
    outs = []
    for c, p in zip(commands, procs):
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"prefect {' '.join(c)} failed:\n{out}"
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def pools(prefect_server):
    srv = prefect_server
    _cli_parallel(srv, *[("work-pool", "create", pool, "--type", kind, "--base-job-template", str(INFRA / tmpl))
                         for pool, (kind, tmpl) in POOLS.items()])
    return srv


@pytest.fixture(scope="module")
def deployed(pools):
    srv = pools
    srv.cli("deploy", "--all", "--prefect-file", "infra/prefect.yaml", "--no-prompt")
    return srv


def test_work_pools_created_from_templates_read_back(pools):
    from prefect import get_client

    out = pools.cli("work-pool", "inspect", "vidax-tpu-large", "--output", "json").stdout
    wp = json.loads(out)
    assert wp["type"] == "kubernetes" and wp["base_job_template"] == _template(TPU)

    async def go():
        async with get_client() as c:
            return {p: await c.read_work_pool(p) for p in POOLS}

    for pool, wp in _run(go()).items():
        kind, tmpl = POOLS[pool]
        assert wp.type == kind
        assert wp.base_job_template == _template(tmpl), pool


def test_a_template_with_an_undeclared_variable_is_refused(pools, tmp_path):
    bad = _template(TPU)
    del bad["variables"]["properties"]["tpu_topology"]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(bad))
    r = pools.cli("work-pool", "create", "vidax-bad", "--type", "kubernetes", "--base-job-template", str(f), check=False)
    assert r.returncode != 0 and "tpu_topology" in r.stdout + r.stderr


def test_prefect_deploy_all_onto_the_templated_pools(deployed):
    from prefect import get_client

    cfg = {d["name"]: d for d in _prefect_yaml()["deployments"]}

    async def go():
        async with get_client() as c:
            return {n: await c.read_deployment_by_name(f"{_flow_names()[d['entrypoint'].split(':')[1]]}/{n}")
                    for n, d in cfg.items()}

    for name, dep in _run(go()).items():
        assert dep.work_pool_name == cfg[name]["work_pool"]["name"]


def _stage_deployment(name):
    from prefect import get_client

    async def go():
        async with get_client() as c:
            return await c.read_deployment_by_name(f"vidax-stage/{name}")

    return _run(go())


def _create_run(deployment, job_variables):
    from prefect import get_client

    async def go():
        async with get_client() as c:
            return await c.create_flow_run_from_deployment(
                deployment.id, parameters={"store": "gs://b/vidax", "run_id": "r1", "stage": "sample"},
                job_variables=job_variables)

    return _run(go())


def _expand(text: str, env: dict) -> str:
    """Kubernetes' ``$(VAR)`` expansion in a container's args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def tpu_pod(job_variables: dict, flow_run, job_name: str = "vidax-stage-abcde", index: int = 1):
    """What pod ``index`` of the TPU template's Job for ``flow_run`` runs: the manifest (rendered by
    Prefect's job-configuration code, then prepared for the flow run as a worker does), the
    container's environment list (the worker's variables first, then the template's), that
    environment as the pod sees it (downward-API values filled in: the Job's name and the pod's
    completion index; ``$(VAR)`` expanded) and the command it runs (``args``, split and expanded)."""
    import shlex

    cfg = render(TPU, job_variables)
    cfg.prepare_for_flow_run(flow_run)
    c = _pod(cfg.job_manifest)["containers"][0]
    env_list = [*({"name": k, "value": v} for k, v in cfg.env.items()), *c["env"]]
    downward = {"metadata.labels['job-name']": job_name,
                "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(index)}
    env: dict[str, str] = {}
    for e in env_list:  # in order: a $(VAR) reference sees the entries before it
        if "valueFrom" in e:
            env[e["name"]] = downward[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = _expand(e.get("value", ""), env)
    return cfg.job_manifest, env_list, env, [_expand(a, env) for a in shlex.split(c["args"])]


TWO_HOSTS = {"tpu_accelerator": "tpu-v5p-slice", "tpu_topology": "2x2x2", "tpu_chips": 4, "tpu_hosts": 2}


def test_tpu_template_renders_a_two_host_indexed_job(deployed):
    """``tpu_hosts: 2``, accepted by the server's schema: an Indexed Job of two pods, each running
    ``vidax stage --flow-run <its flow run> --processes 2`` as JAX process <its completion index>,
    with pod 0 (through the headless Service) as the coordinator; one host: the same command, one
    process, which runs the flow run itself."""
    from flows.cli import follower_command

    fr = _create_run(_stage_deployment("sample"), TWO_HOSTS)
    assert fr.job_variables["tpu_hosts"] == 2
    m, env_list, env, argv = tpu_pod(fr.job_variables, fr)
    assert not _missing_paths(m, K8S_REQUIRED)
    _assert_no_placeholders(m)
    spec = m["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert _pod(m)["subdomain"] == "vidax-tpu" and _pod(m)["restartPolicy"] == "Never"
    assert all(set(e) in ({"name", "value"}, {"name", "valueFrom"}, {"name"}) and isinstance(e.get("value", ""), str)
               for e in env_list), env_list  # Kubernetes EnvVar objects, string values only
    assert env["PREFECT__FLOW_RUN_ID"] == str(fr.id)
    assert env["VIDAX_PROCESS_ID"] == "1"
    assert env["VIDAX_COORDINATOR"] == "vidax-stage-abcde-0.vidax-tpu:8476"  # pod 0's DNS name
    assert env["VIDAX_LEADER_COMMAND"] == ""  # no `command` job variable: pod 0 runs the Prefect engine
    assert argv == follower_command(str(fr.id), 2).split()
    one = _create_run(_stage_deployment("sample"), {"tpu_hosts": 1})
    m1, _, env1, argv1 = tpu_pod(one.job_variables, one, index=0)
    assert (m1["spec"]["completions"], m1["spec"]["parallelism"]) == (1, 1)
    assert argv1 == follower_command(str(one.id), 1).split() and env1["VIDAX_PROCESS_ID"] == "0"
    custom = _create_run(_stage_deployment("sample"), {**TWO_HOSTS, "command": "python -m prefect flow-run execute"})
    assert tpu_pod(custom.job_variables, custom)[2]["VIDAX_LEADER_COMMAND"] == "python -m prefect flow-run execute"


def test_server_enforces_tpu_job_variables_on_flow_runs(deployed):
    dep = _stage_deployment("sample")
    fr = _create_run(dep, {k: v for k, v in TPU_VARS.items() if k != "image"})
    assert fr.job_variables["tpu_topology"] == "2x2x4"
    for bad in ({"tpu_topology": "big"}, {"tpu_chips": 16}, {"tpu_accelerator": "v5p"}, {"tpu_hosts": 0}):
        with pytest.raises(Exception) as e:
            _create_run(dep, bad)
        assert "422" in str(e.value) or "Unprocessable" in str(e.value), (bad, e.value)


def _post_events(srv, events):
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    body = json.dumps([{"id": str(uuid.uuid4()), "occurred": now, **e} for e in events]).encode()
    req = urllib.request.Request(f"{srv.api}/events", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 204


def _webhook_event(body, headers=None):
    import jinja2.sandbox

    t = jinja2.sandbox.SandboxedEnvironment().from_string((INFRA / "gcs-webhook-template.jinja").read_text())
    return json.loads(t.render(body=body, headers=headers or {}))


def _runs_of(deployment_name):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def go():
        async with get_client() as c:
            return await c.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment_name])))

    return _run(go())


def test_webhook_template_maps_every_gcs_notification_shape():
    obj = {"bucket": "vb", "name": "prompts/day 1.jsonl", "generation": "17", "size": "42", "contentType": "application/json"}
    expected = {"prefect.resource.id": "gcs.object.vb/prompts/day 1.jsonl", "gcs.bucket": "vb",
                "gcs.name": "prompts/day 1.jsonl", "gcs.generation": "17"}
    pubsub = {"message": {"attributes": {"eventType": "OBJECT_FINALIZE", "bucketId": "vb", "objectId": obj["name"],
                                         "objectGeneration": "17", "payloadFormat": "JSON_API_V1"},
                          "data": base64.b64encode(json.dumps(obj).encode()).decode(), "messageId": "1"},
              "subscription": "projects/p/subscriptions/vidax"}
    binary = (obj, {"ce-type": "google.cloud.storage.object.v1.finalized", "ce-subject": f"objects/{obj['name']}"})
    structured = {"specversion": "1.0", "type": "google.cloud.storage.object.v1.finalized", "id": "1",
                  "source": "//storage.googleapis.com/projects/_/buckets/vb", "data": obj}
    for ev in (_webhook_event(pubsub), _webhook_event(*binary), _webhook_event(structured)):
        assert ev["event"] == "google.cloud.storage.object.v1.finalized"
        assert {k: ev["resource"][k] for k in expected} == expected
    deleted = copy.deepcopy(pubsub)
    deleted["message"]["attributes"]["eventType"] = "OBJECT_DELETE"
    assert _webhook_event(deleted)["event"] == "google.cloud.storage.object.v1.deleted"
    tricky = _webhook_event({**obj, "name": 'prompts/a"b\\c.txt'}, binary[1])  # names are JSON-escaped
    assert tricky["resource"]["gcs.name"] == 'prompts/a"b\\c.txt'


def test_gcs_finalize_and_decode_failure_events_start_the_right_runs(deployed):
    srv = deployed
    notification = {"message": {"attributes": {"eventType": "OBJECT_FINALIZE", "bucketId": "vidax-in",
                                               "objectId": "prompts/batch-7.jsonl", "objectGeneration": "3"}}}
    elsewhere = copy.deepcopy(notification)
    elsewhere["message"]["attributes"]["objectId"] = "uploads/batch-8.jsonl"

    def failed(stage, attempt):
        return {"event": "vidax.stage.failed", "payload": {"error": "boom"},
                "resource": {"prefect.resource.id": f"vidax.run.r9.{stage}", "vidax.store": "gs://b/vidax",
                             "vidax.run_id": "r9", "vidax.stage": stage, "vidax.stage_kind": stage.split("/")[0],
                             "vidax.attempt": str(attempt)}}

    _post_events(srv, [_webhook_event(elsewhere), failed("decode/1", 2), failed("sample", 1),
                       _webhook_event(notification), failed("decode/1", 1)])
    deadline = time.time() + 45
    batch, rerun = [], []
    while time.time() < deadline and not (batch and rerun):
        batch = [r for r in _runs_of("generate-batch") if r.parameters.get("prompt_file", "").startswith("gs://vidax-in/")]
        rerun = [r for r in _runs_of("rerun-stage") if r.parameters.get("run_id") == "r9"]
        time.sleep(1)
    time.sleep(2)  # a run for a non-matching event would have been created by now too
    batch, rerun = _runs_of("generate-batch"), _runs_of("rerun-stage")
    # the session's server is shared with other test files: look only at this test's runs
    batch = [r for r in batch if r.parameters.get("prompt_file", "").startswith("gs://vidax-in/")]
    rerun = [r for r in rerun if r.parameters.get("run_id") == "r9"]
    assert [r.parameters["prompt_file"] for r in batch] == ["gs://vidax-in/prompts/batch-7.jsonl"]
    assert [(r.parameters["run_id"], r.parameters["stage"], r.parameters["store"]) for r in rerun] == \
        [("r9", "decode/1", "gs://b/vidax")]


def test_deployments_do_not_pull_from_the_deploying_machine(deployed):
    from prefect import get_client

    async def go():
        async with get_client() as c:
            return [await c.read_deployment_by_name(f"vidax-stage/{n}") for n in ("encode", "sample", "decode", "mux")]

    for dep in _run(go()):
        steps = json.dumps(dep.pull_steps or [])
        assert str(REPO) not in steps, f"{dep.name}: {steps}"
