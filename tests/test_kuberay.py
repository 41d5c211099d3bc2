"""`imgtrain cluster manifest`: the RayJob and RayCluster it writes are valid against KubeRay's own
CRDs (v1.7.0, tests/data/kuberay/) as the API server and `kubectl apply` (strict field
validation) check them, run exactly the command given, and give every pod the image, the
credentials and the GPUs asked for; what a cluster could not run is refused in one line.
No Kubernetes runs here: these are the manifests' checks, not a cluster's."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import shlex
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.conftest import cli_here

CRDS = Path(__file__).parent / "data" / "kuberay"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml.gz", "RayCluster": "ray.io_rayclusters.yaml.gz"}
IMAGE = "registry.example.com/ml/imgtrain:0.1.0"
JOB = ["train", "--data", "s3://bucket/data sets/mnist", "--storage", "s3://bucket/runs", "--name", "big",
       "--workers", "4"]


# ---------------------------------------------------------------- the CRDs' schemas, as Kubernetes applies them


def strict(schema: dict) -> dict:
    """A CRD's structural schema as JSON Schema: an object's unknown field is an error (kubectl's
    --validate=strict; the API server would drop it silently), and int-or-string stated as such."""
    s = dict(schema)
    if "properties" in s:
        s["properties"] = {name: strict(sub) for name, sub in s["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(s.get(key), dict):
            s[key] = strict(s[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in s:
            s[key] = [strict(sub) for sub in s[key]]
    if s.get("x-kubernetes-int-or-string") and "anyOf" not in s:
        s.pop("type", None)
        s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (s.get("type") == "object" and "properties" in s and "additionalProperties" not in s
            and not s.get("x-kubernetes-preserve-unknown-fields")):
        s["additionalProperties"] = False
    return s


def unique_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-map-keys: two list entries with the same keys (two ports 8265) are refused."""
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else None
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry {dict(zip(keys, key))}")
        seen.add(key)


# OpenAPI 3.0's schema dialect is draft 4's; the other x-kubernetes-* keywords are annotations.
KubernetesValidator = jsonschema.validators.extend(jsonschema.Draft4Validator,
                                                   {"x-kubernetes-list-map-keys": unique_map_keys})


@functools.cache
def crd_schema(kind: str) -> dict:
    with gzip.open(CRDS / CRD_FILES[kind], "rt") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"]]
    return strict(v1["schema"]["openAPIV3Schema"])


def crd_problems(doc: dict) -> list[str]:
    """Why KubeRay's CRD (the served v1) refuses ``doc``; empty when it takes it."""
    if doc.get("apiVersion") != "ray.io/v1" or doc.get("kind") not in CRD_FILES:
        return [f"not a ray.io/v1 RayJob or RayCluster: {doc.get('apiVersion')} {doc.get('kind')}"]
    errors = KubernetesValidator(crd_schema(doc["kind"])).iter_errors(doc)
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


# ---------------------------------------------------------------- helpers


def manifest(capsys, *options: str, command: list[str] | None = JOB):
    """The parsed manifest and the command's result."""
    after = ["--", *command] if command else []
    result = cli_here(capsys, "cluster", "manifest", "--image", IMAGE, *options, *after)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout), result


def cluster_of(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pods(doc: dict) -> list[dict]:
    """The head's pod spec, then each worker group's."""
    cluster = cluster_of(doc)
    return [g["template"]["spec"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def containers(doc: dict) -> list[dict]:
    return [c for pod in pods(doc) for c in pod["containers"]]


# ---------------------------------------------------------------- what a user relies on


def test_a_rayjob_is_valid_against_kuberays_crd_and_runs_exactly_the_command(capsys):
    doc, result = manifest(capsys, "--secret", "s3-keys")
    assert crd_problems(doc) == []
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == ("ray.io/v1", "RayJob", "imgtrain-big")
    entrypoint = doc["spec"]["entrypoint"]
    # the job runs it through a shell: the words come back exactly, the one with a space included
    assert shlex.split(entrypoint) == ["imgtrain", *JOB, "--address", "auto"]
    assert entrypoint == shlex.join(["imgtrain", *JOB, "--address", "auto"])
    assert doc["spec"]["shutdownAfterJobFinishes"] is True
    assert cluster_of(doc)["rayVersion"] == version("ray")
    assert cluster_of(doc)["authOptions"] == {"mode": "token"}
    assert [g["replicas"] for g in cluster_of(doc)["workerGroupSpecs"]] == [2]
    assert result.stdout.startswith("# RayJob") and result.stderr == ""


def test_a_raycluster_is_valid_and_says_how_to_submit_the_command(capsys):
    doc, result = manifest(capsys, "--kind", "raycluster", "--name", "team-a", "--secret", "s3-keys")
    assert crd_problems(doc) == []
    assert doc["kind"] == "RayCluster" and "entrypoint" not in doc["spec"]
    comments = [line for line in result.stdout.splitlines() if line.startswith("#")]
    assert "#   kubectl port-forward svc/team-a-head-svc 8265:8265 &" in comments
    assert f"#   ray job submit --address http://127.0.0.1:8265 -- {shlex.join(['imgtrain', *JOB, '--address', 'auto'])}" \
        in comments
    alone, _ = manifest(capsys, "--kind", "raycluster", "--auth", "none", command=None)
    assert crd_problems(alone) == [] and "authOptions" not in alone["spec"]


@pytest.mark.parametrize("kind", ["rayjob", "raycluster"])
def test_every_container_has_the_image_and_the_secret(capsys, kind):
    doc, _ = manifest(capsys, "--kind", kind, "--secret", "s3-keys", "--pods", "3")
    assert len(containers(doc)) == 2 and cluster_of(doc)["workerGroupSpecs"][0]["replicas"] == 3
    for container in containers(doc):  # the driver (head) and the workers all read and write the bucket
        assert container["image"] == IMAGE
        assert container["envFrom"] == [{"secretRef": {"name": "s3-keys"}}]


def test_without_credentials_stdout_is_still_pure_yaml_and_the_warning_goes_to_stderr(capsys):
    doc, result = manifest(capsys)
    assert crd_problems(doc) == [] and all("envFrom" not in c for c in containers(doc))
    assert result.stderr.startswith("warning: s3://bucket/runs: neither --secret nor --service-account")
    assert yaml.safe_load(result.stdout) == doc


def test_gpus_are_on_the_worker_pods_and_nowhere_else(capsys):
    command = [*JOB, "--gpu"]
    doc, _ = manifest(capsys, "--gpus-per-pod", "2", "--secret", "s3-keys", command=command)
    assert crd_problems(doc) == []
    head, workers = cluster_of(doc)["headGroupSpec"], cluster_of(doc)["workerGroupSpecs"][0]
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "2" == worker["resources"]["requests"]["nvidia.com/gpu"]
    assert workers["rayStartParams"] == {"num-gpus": "2"}
    assert "nvidia.com/gpu" not in str(head) and head["rayStartParams"] == {"num-cpus": "0"}
    cpu_only, result = manifest(capsys, "--secret", "s3-keys")
    assert "nvidia.com/gpu" not in result.stdout and "num-gpus" not in result.stdout


def test_out_writes_the_manifest_to_a_file_and_nothing_to_stdout(capsys, tmp_path):
    _, printed = manifest(capsys, "--secret", "s3-keys")
    out = tmp_path / "job.yaml"
    result = cli_here(capsys, "cluster", "manifest", "--image", IMAGE, "--secret", "s3-keys", "--out", str(out),
                      "--", *JOB)
    assert result.returncode == 0 and result.stdout == ""
    assert out.read_text() == printed.stdout
    assert f"kubectl apply -f {out}" in result.stderr


def test_a_shared_volume_holds_local_storage_and_data(capsys):
    command = ["train", "--data", "/mnt/shared/data/my photos", "--storage", "/mnt/shared/runs", "--name", "x"]
    doc, result = manifest(capsys, "--pvc", "runs-rwx:/mnt/shared", command=command)
    assert crd_problems(doc) == [] and result.stderr == ""
    for pod in pods(doc):
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": "runs-rwx"}} in pod["volumes"]
        assert {"name": "shared", "mountPath": "/mnt/shared"} in pod["containers"][0]["volumeMounts"]
    assert shlex.split(doc["spec"]["entrypoint"])[1:] == [*command, "--address", "auto"]


S3 = ["--storage", "s3://b/runs", "--name", "x"]


@pytest.mark.parametrize("options, command, says", [
    (["--name", "Big"], JOB, "--name 'Big' must be a DNS-1035 label of at most 47 characters"),
    (["--name", "a" * 48], JOB, "at most 47 characters"),
    (["--kind", "raycluster", "--name", "a" * 51], JOB, "at most 50 characters"),
    (["--kind", "rayservice"], JOB, "--kind 'rayservice' is not one of rayjob, raycluster"),
    (["--pods", "0"], JOB, "--pods must be at least 1, got 0"),
    (["--memory-per-pod", "8GB"], JOB, "--memory-per-pod '8GB' is not an amount of memory"),
    (["--secret", "S3_keys"], JOB, "--secret 'S3_keys' is not a Kubernetes object name"),
    (["--ray-version", "2.60"], JOB, "--ray-version '2.60' is not a version"),
    (["--ray-version", "2.40.0"], JOB, "--auth token needs Ray 2.52.0 or later"),
    (["--pvc", "runs-rwx"], JOB, "--pvc 'runs-rwx': give CLAIM:/mount/path"),
    ([], None, "a RayJob runs a command: give it after --"),
    ([], ["train", "--name", "x"], "--storage ./runs is a path on each pod's own disk"),
    (["--pvc", "v:/mnt/shared"], ["train", "--name", "x", "--storage", "/data/runs"], "under the --pvc mount /mnt/shared"),
    ([], ["trian", *S3], "the command after --: 'imgtrain' has no command 'trian'"),
    ([], ["train", *S3, "--bogus"], "No such option: --bogus"),
    ([], ["train", *S3, "--epochs", "0"], "--epochs must be at least 1"),
    ([], ["train", "--storage", "s3://b/runs"], "--name is required"),
    ([], ["train", *S3, "--help"], "holds --help"),
    ([], ["train", *S3, "--gpu"], "the pods have none: pass --gpus-per-pod N"),
    (["--gpus-per-pod", "1"], ["train", *S3, "--gpu", "--workers", "4"], "hold 2 of the command's 4 training workers"),
    (["--pods", "1"], ["train", *S3, "--workers", "4"],
     "hold 4 CPUs; the command's 4 training workers and Ray Data's reads need 5"),
    ([], ["data"], "'imgtrain data' needs one of its commands: inspect, prepare"),
])
def test_what_a_cluster_could_not_run_is_refused_in_one_line(capsys, options, command, says):
    after = ["--", *command] if command else []
    result = cli_here(capsys, "cluster", "manifest", "--image", IMAGE, "--secret", "k", *options, *after)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr


def test_an_image_is_required(capsys):
    result = cli_here(capsys, "cluster", "manifest", "--", *JOB)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: --image is required: a container image with imgtrain and Ray {version('ray')}")


# ---------------------------------------------------------------- the command's way to the head, through two shells

# What KubeRay v1.7.0's submitter pod runs (ray-operator/controllers/ray/common/job.go,
# BuildJobSubmitCommand, K8sJobMode; its wait for the dashboard left out): one bash script, the
# entrypoint in it as the RayJob gives it (trimmed), run as /bin/bash -ce -- SCRIPT.
ADDRESS, JOB_ID = "http://imgtrain-big-head-svc.default.svc.cluster.local:8265", "imgtrain-big-x7k2p"


def submitter_script(entrypoint: str) -> str:
    return " ".join(["if", "!", "ray", "job", "status", "--address", ADDRESS, JOB_ID, ">/dev/null", "2>&1", ";",
                     "then", "ray", "job", "submit", "--address", ADDRESS, "--no-wait", "--submission-id", JOB_ID,
                     "--", entrypoint.strip(), ";", "fi", ";", "ray", "job", "logs", "--address", ADDRESS, "--follow",
                     JOB_ID])


# `ray` on the submitter: `job status` says no such job yet, `job logs` has nothing to follow, and
# `job submit` joins the words after -- as the Ray of the image does, then runs the line as the
# job's supervisor on the head does (job_supervisor.py: Popen(entrypoint, shell=True)). "installed"
# is this machine's Ray's own `ray job submit` (2.56 and later join with shlex.join), only its
# HTTP client to the job server replaced; "list2cmdline" is Ray 2.55's and before
# (dashboard/modules/job/cli.py: `entrypoint=list2cmdline(entrypoint)`).
RAY = """
import os, subprocess, sys
args = sys.argv[1:]
if args[:2] == ["job", "status"]:
    sys.exit(1)
if args[:2] == ["job", "logs"]:
    sys.exit(0)
assert args[:2] == ["job", "submit"], args


def supervise(entrypoint):
    subprocess.run(entrypoint, shell=True, check=True)


if os.environ["RAY_JOIN"] == "list2cmdline":
    supervise(subprocess.list2cmdline(args[args.index("--") + 1:]))
else:
    from ray.dashboard.modules.job import cli

    class JobServer:
        def submit_job(self, *, entrypoint, submission_id=None, **_):
            supervise(entrypoint)
            return submission_id

        def get_version(self):  # an old job server: the CLI follows no logs
            return "0"

    cli._get_sdk_client = lambda *args, **kwargs: JobServer()
    cli.job_cli_group.main(args[1:], prog_name="ray job")
"""
IMGTRAIN = """
import json, os, sys
with open(os.environ["ARGV_OUT"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def run_in_shells(tmp_path, script: str, join: str) -> list[list[str]]:
    """``script`` run by bash with the stand-in `ray` and `imgtrain` first on PATH, in an empty
    folder: the argv of each `imgtrain` it ran. Whatever else it ran it leaves in the folder."""
    bin_dir, work, out = tmp_path / "bin", tmp_path / "work", tmp_path / "argv.jsonl"
    bin_dir.mkdir()
    work.mkdir()
    for name, body in (("ray", RAY), ("imgtrain", IMGTRAIN)):
        (bin_dir / name).write_text(f"#!{sys.executable} -I\n{body}")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "RAY_JOIN": join,
           "ARGV_OUT": str(out)}
    result = subprocess.run(["/bin/bash", "-ce", "--", script], cwd=work, env=env, capture_output=True, text=True,
                            timeout=120)
    assert list(work.iterdir()) == [], f"the shells ran more than the command: {result.stderr}"
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


# Values each shell would read as code or cut, were they not quoted for it: the review's `;` and
# ${IFS} (a space) and `#`, expansions, both quotes, backslashes, spaces at the ends and in a
# row, an empty value, an option-like one, globs, history and braces, unicode.
HOSTILE = ["s3://b/x;touch${IFS}M;#", "$1", "${IFS}", "`touch B`", "$(touch C)", "it's 'quoted'", 'say "hi"', '\\"',
           "back\\slash\\", "#not a comment", "  two  spaces  ", "", "-x", "é ü 中文 🙂", "*", "~", "{a,b}", "!!",
           "&& touch D", "| touch E", "> F", "a'\"'b\"'", "\\ ", "%s", "a=b c"]
HOSTILE_COMMAND = ["train", "--data", HOSTILE[0], "--storage", "s3://b/runs", "--name", "big",
                   *[word for value in HOSTILE for word in ("--mlflow-experiment", value)]]


@pytest.mark.parametrize("ray_version, join", [(version("ray"), "installed"), ("2.55.1", "list2cmdline")])
def test_the_rayjob_runs_exactly_the_command_through_the_submitters_shell_and_the_heads(capsys, tmp_path, ray_version,
                                                                                       join):
    doc, _ = manifest(capsys, "--secret", "s3-keys", "--ray-version", ray_version, command=HOSTILE_COMMAND)
    ran = run_in_shells(tmp_path, submitter_script(doc["spec"]["entrypoint"]), join)
    assert ran == [[*HOSTILE_COMMAND, "--address", "auto"]]
    assert crd_problems(doc) == [] and doc["spec"]["submissionMode"] == "K8sJobMode"  # the path quoted for, stated


def test_the_rayclusters_submit_line_runs_exactly_the_command(capsys, tmp_path):
    """The line its comments give, typed into bash here, submitted by this machine's Ray."""
    _, result = manifest(capsys, "--kind", "raycluster", "--ray-version", "2.55.1", command=HOSTILE_COMMAND)
    (line,) = [line.removeprefix("#   ") for line in result.stdout.splitlines() if "ray job submit" in line]
    assert run_in_shells(tmp_path, line, "installed") == [[*HOSTILE_COMMAND, "--address", "auto"]]


@pytest.mark.parametrize("join, ray_version", [("list2cmdline", "2.55.1"), ("list2cmdline", "2.40.0"),
                                               ("installed", version("ray"))])
def test_any_word_comes_through_the_shells_byte_for_byte(tmp_path, join, ray_version):
    """The quoting alone, with what the CLI refuses before it (newlines), every printable ASCII
    character on its own and beside a space, and words drawn from the shells' special characters."""
    import random

    from imgtrain.kuberay import entrypoint

    draw, special = random.Random(45), " \"'\\$`;#&|<>(){}[]*?~!%=\nab"
    words = ["imgtrain", *HOSTILE, "line\nbreak", "\n", *[chr(c) for c in range(33, 127)],
             *[f" {chr(c)} " for c in range(33, 127)], "".join(map(chr, range(32, 127))),
             *["".join(draw.choices(special, k=draw.randint(0, 12))) for _ in range(200)]]
    assert run_in_shells(tmp_path, submitter_script(entrypoint(words, ray_version)), join) == [words[1:]]


def test_a_tab_is_refused_for_a_ray_that_joins_with_list2cmdline():
    from imgtrain.errors import ImgtrainError
    from imgtrain.kuberay import entrypoint

    with pytest.raises(ImgtrainError, match="holds a tab"):
        entrypoint(["imgtrain", "a\tb"], "2.55.1")


# ---------------------------------------------------------------- credentials stay out of the manifest


@pytest.mark.parametrize("kind", ["rayjob", "raycluster"])
@pytest.mark.parametrize("words, option, says", [
    (["--mlflow", "http://alice:PW-s3cr3t@mlflow.example.com:5000"], "--mlflow", "a user name and password"),
    (["--mlflow=https://PW-s3cr3t@mlflow.example.com"], "--mlflow", "a user name or token"),
    (["--mlflow", "http://h/?next=http://alice:PW-s3cr3t@h"], "--mlflow", "a user name and password"),
    (["--storage", "s3://AKIA:PW-s3cr3t@bucket/runs"], "--storage", "a user name and password in its s3:// URL"),
    (["--data", "abfs://:PW-s3cr3t@account.dfs.core.windows.net/data"], "--data", "a user name and password"),
    (["--data", "gs://bucket/data?access_key=AKIA&secret_key=PW-s3cr3t"], "--data", "the parameter access_key="),
    (["--init-from", "s3://b/w.pt?X-Amz-Signature=PW-s3cr3t"], "--init-from", "the parameter X-Amz-Signature="),
])
def test_credentials_in_the_command_are_refused_without_showing_them(capsys, kind, words, option, says):
    command = ["train", "--data", "s3://bucket/data", "--storage", "s3://bucket/runs", "--name", "big", *words]
    result = cli_here(capsys, "cluster", "manifest", "--image", IMAGE, "--kind", kind, "--secret", "k", "--", *command)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: the command after -- has credentials in {option}: {says}")
    assert result.stderr.count("\n") == 1 and "PW-s3cr3t" not in result.stderr
    assert "--secret" in result.stderr and "MLFLOW_TRACKING_PASSWORD" in result.stderr


def test_urls_without_credentials_pass(capsys):
    command = ["train", "--data", "abfs://container@account.dfs.core.windows.net/data", "--storage", "s3://b/runs",
               "--name", "big", "--mlflow", "http://mlflow.example.com:5000/?experiment=x", "--mlflow-experiment",
               "team@example.com"]
    doc, _ = manifest(capsys, "--secret", "k", command=command)
    assert shlex.split(doc["spec"]["entrypoint"]) == ["imgtrain", *command, "--address", "auto"]


# ---------------------------------------------------------------- the schema check itself bites


@pytest.mark.parametrize("mistake, says", [
    (lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"].update(rayStartParam={}), "'rayStartParam' was unexpected"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas="2"), "is not of type 'integer'"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(rayStartParams={"num-gpus": 1}),
     "1 is not of type 'string'"),
    (lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required"),
    (lambda d: containers(d)[1]["resources"]["limits"].update(memory="8 GB"), "does not match"),
    (lambda d: containers(d)[0]["ports"].append({"containerPort": 8265}), "duplicate entry"),
    (lambda d: d["spec"].update(shutdownAfterJobFinishes="true"), "is not of type 'boolean'"),
])
def test_the_crd_check_refuses_what_kubernetes_would(capsys, mistake, says):
    doc, _ = manifest(capsys, "--secret", "s3-keys")
    broken = copy.deepcopy(doc)
    mistake(broken)
    problems = crd_problems(broken)
    assert problems and any(says in p for p in problems), problems


# ---------------------------------------------------------------- the docs show what the command writes


def is_within(excerpt, whole) -> bool:
    """Every key and value of ``excerpt`` is in ``whole`` (lists entry by entry)."""
    if isinstance(excerpt, dict):
        return isinstance(whole, dict) and all(k in whole and is_within(v, whole[k]) for k, v in excerpt.items())
    if isinstance(excerpt, list):
        return isinstance(whole, list) and len(excerpt) == len(whole) and all(map(is_within, excerpt, whole))
    return excerpt == whole


def test_the_docs_manifests_are_valid_and_their_excerpt_is_what_the_command_writes(capsys, tmp_path):
    from tests.test_docs import FENCE, ROOT, commands, shell_lines

    page = ROOT / "docs" / "clusters.md"
    shown = [words[1:] for _, line in shell_lines(page) for words in commands(line)
             if words[:3] == ["imgtrain", "cluster", "manifest"]]
    assert len(shown) == 2, shown
    written = []
    for args in shown:
        out = args.index("--out") + 1
        args[out] = str(tmp_path / args[out])
        result = cli_here(capsys, *args)
        assert result.returncode == 0, result.stderr
        written.append(yaml.safe_load(Path(args[out]).read_text()))
        assert crd_problems(written[-1]) == []
    (excerpt,) = [yaml.safe_load(block) for block in FENCE.findall(page.read_text()) if "kind: RayJob" in block]
    assert is_within(excerpt, written[0])
