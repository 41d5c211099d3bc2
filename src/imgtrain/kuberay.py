"""KubeRay manifests (``imgtrain cluster manifest``): a RayJob that runs one imgtrain command on a
RayCluster made for it, or a RayCluster alone to submit commands to.

Everything a pod cannot get right by itself is refused here, before a cluster is asked for: the
command must parse (it is imgtrain's own parser that reads it), runs must go where every pod
and the next cluster see them (a pod's disk is its own, and goes with it), and the pods must
hold the Ray Train workers the command asks for (Ray would wait for them forever). Credentials in
the command are refused (the manifest and Ray's job list would show them), and the command is
quoted for the two shells it goes through on its way to the head (SHLEX_JOIN_SINCE).
The manifests follow KubeRay's ray.io/v1 CRDs; tests/test_kuberay.py checks them against the
CRDs' schemas (tests/data/kuberay/).
"""

from __future__ import annotations

import posixpath
import re
import shlex
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import PurePosixPath

from imgtrain.config import TrainConfig, parse_workers, resolve, validate
from imgtrain.errors import ImgtrainError, ImgtrainWarning, one_line
from imgtrain.ops.remote import is_remote
from imgtrain.settings import option

KINDS = ("rayjob", "raycluster")
AUTH_MODES = ("token", "none")
# KubeRay's limits (ray-operator/controllers/ray/utils/constant.go, util.go CheckName): a RayJob's
# cluster is named after it with 6 more characters, and every pod and service after the cluster.
MAX_NAME = {"rayjob": 47, "raycluster": 50}  # a RayCluster's 51-53: KubeRay cuts its pods' and Secret's names
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
RAY_VERSION = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+$")
TOKEN_AUTH_SINCE = (2, 52, 0)  # KubeRay refuses authOptions.mode token for an older rayVersion
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))
TTL_AFTER_JOB_S = 300  # the finished job's pods stay this long for `kubectl logs`, then go

# How a RayJob's entrypoint reaches the head (KubeRay v1.3 to v1.7, ray-operator/controllers/ray/
# common/job.go BuildJobSubmitCommand, in K8sJobMode): the submitter pod runs
#   /bin/bash -ce -- "... ray job submit --address ... --submission-id ID -- ENTRYPOINT ; fi ; ..."
# so bash reads ENTRYPOINT into words (KubeRay 1.2 split it with google/shlex, which reads the
# same quoting, and ran `ray` without a shell). `ray job submit` joins those words into one line
# again, and the job's supervisor on the head runs that line with /bin/sh -c (dashboard/modules/
# job/job_supervisor.py, Popen(shell=True)): two shells, a join between them. Ray 2.56 and later
# join with shlex.join, quoted for sh, so the words quoted once, for bash, reach the command as
# they are. Ray 2.55 and before join with subprocess.list2cmdline, Windows' quoting, which quotes
# only spaces, in double quotes, where sh still expands $ and `: the words would reach sh bare,
# and `s3://b/x;touch${IFS}M` would run `touch M` on the head. For those Rays each word is first
# written for sh in pieces list2cmdline passes on unchanged (_sh_for_list2cmdline), and the
# pieces are quoted for bash.
SHLEX_JOIN_SINCE = (2, 56, 0)  # ray/dashboard/modules/job/cli.py: 2.55.1 list2cmdline, 2.56.0 shlex.join
# A URL's user name and password (http://alice:PW@host, s3://KEY:SECRET@bucket), and query
# parameters that carry a secret: S3's ?secret_key=, an Azure SAS's sig=, a presigned URL's
# X-Amz-Signature=. abfs:// names the container before the @ (abfs://container@account/...).
SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
USERINFO_NAMES_NO_USER = ("abfs", "abfss")
SECRET_PARAMETER = re.compile(r"secret|passw|pwd|token|key|signature|^sig$", re.IGNORECASE)


def installed_ray() -> str:
    """This machine's Ray: the image's unless --ray-version says."""
    return version("ray")


@dataclass(frozen=True)
class Spec:
    """What the manifest asks Kubernetes for: every option of ``imgtrain cluster manifest``."""

    kind: str = option("rayjob", "rayjob: a RayJob, a cluster made for the command and gone after it; raycluster: "
                       "a RayCluster alone, to `ray job submit` commands to.", choices=KINDS)
    name: str | None = option(None, "The RayJob's or RayCluster's name, a DNS-1035 label",
                              shown="imgtrain-RUN, RUN the command's --name")  # None: ``default_name``
    image: str | None = option(None, "Container image holding imgtrain and the same Ray as --ray-version (no public "
                               "image has imgtrain: docs/clusters.md shows a Dockerfile). Required.")
    pods: int = option(2, "Worker pods, beside the head pod (which runs the driver, no training).")
    cpus_per_pod: int = option(4, "CPUs of each worker pod (the command's Ray Train workers and Ray Data share "
                               "them).")
    gpus_per_pod: int = option(0, "NVIDIA GPUs of each worker pod (nvidia.com/gpu).")
    memory_per_pod: str = option("8Gi", "Memory of each worker pod, in Kubernetes' units.")
    head_cpus: int = option(2, "CPUs of the head pod.")
    head_memory: str = option("8Gi", "Memory of the head pod.")
    secret: str | None = option(None, "A Kubernetes Secret whose keys become the environment of the head and worker "
                                "containers: the bucket's AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and "
                                "AWS_ENDPOINT_URL, AWS_REGION); MLflow's MLFLOW_TRACKING_USERNAME, "
                                "MLFLOW_TRACKING_PASSWORD. Credentials in the command are refused.")
    service_account: str | None = option(None, "The pods' service account (e.g. one bound to a cloud role that "
                                         "reaches the bucket).")
    pvc: str | None = option(None, "CLAIM:/mount/path: a ReadWriteMany PersistentVolumeClaim mounted in every pod; a "
                             "local --storage is then allowed under that path.")
    ray_version: str | None = option(None, "Ray version of the image", shown=lambda: f"{installed_ray()}, this "
                                     "machine's")  # None: ``installed_ray``
    auth: str = option("token", "token: KubeRay turns on Ray's token authentication (KubeRay 1.6+, Ray 2.52+); "
                       "none: anyone who reaches the pods may submit jobs.", choices=AUTH_MODES)

    def completed(self, command: Command | None) -> Spec:
        """The spec with what was left unset filled in: the name from the command, this machine's Ray."""
        return replace(self, name=default_name(command) if self.name is None else self.name,
                       ray_version=self.ray_version or installed_ray())

    @property
    def mount(self) -> tuple[str, PurePosixPath] | None:
        if not self.pvc:
            return None
        claim, _, path = self.pvc.partition(":")
        return claim, PurePosixPath(path)


@dataclass(frozen=True)
class Command:
    """The imgtrain command the cluster runs, as imgtrain's own parser read it."""

    words: tuple[str, ...]  # after `imgtrain`, with `--address auto` where the command joins Ray
    storage: str | None  # where it keeps runs (its default where not given); None: it keeps none
    data: str | None
    run_name: str | None
    train: TrainConfig | None  # a `train` command's flags over the defaults (not a --config file's)

    def line(self, ray_version: str) -> str:
        """The command as `ray job submit -- LINE` of Ray ``ray_version`` takes it (see SHLEX_JOIN_SINCE)."""
        return entrypoint(["imgtrain", *self.words], ray_version)


def entrypoint(argv: Sequence[str], ray_version: str) -> str:
    """A line that a shell reads into words, which `ray job submit` of Ray ``ray_version``
    joins for the head's /bin/sh, which runs ``argv`` exactly (see SHLEX_JOIN_SINCE)."""
    release = tuple(int(n) for n in re.findall(r"\d+", ray_version)[:3])  # 3.0.0.dev0, a local build: 3.0.0
    if release >= SHLEX_JOIN_SINCE:
        return shlex.join(argv)
    return shlex.join(" ".join(map(_sh_for_list2cmdline, argv)).split(" "))


def _sh_for_list2cmdline(word: str) -> str:
    r"""``word`` quoted for sh so that, cut at its spaces, list2cmdline joins the pieces back as
    they were: a space is written `\ ` (the cut comes after the backslash), no piece is empty
    (`''` closes a word that ends with a space), and a " stands outside quotes, after no
    backslash (list2cmdline writes it \", which sh reads as a "). A tab cannot be written so;
    parse_command refuses it with the other control characters."""
    if "\t" in word:
        raise ImgtrainError("the command after -- holds a tab: pass plain arguments")
    quoted = "".join({" ": "\\ ", "'": "\\'", '"': '"'}.get(run) or shlex.quote(run)
                     for run in re.findall(r"[^ '\"]+|[ '\"]", word))
    return quoted + "''" if not quoted or quoted.endswith(" ") else quoted


def _credentials(word: str) -> str | None:
    """What credentials a URL in ``word`` holds (see SCHEME), said without them; None if none.
    Every scheme:// in the word is looked at: one URL may hold another (?next=http://...)."""
    for url in SCHEME.finditer(word):
        scheme, rest = url[1].lower(), word[url.end():]
        authority = re.match(r"[^/?#]*", rest)[0]
        user, at, _ = authority.rpartition("@")  # up to the last @, as requests reads it: a password may hold one
        if at and ":" in user:
            return f"a user name and password in its {scheme}:// URL"
        if at and scheme not in USERINFO_NAMES_NO_USER:
            return f"a user name or token in its {scheme}:// URL"
        query = re.match(r"[^?#]*\??([^#]*)", rest)[1]
        for name, _ in re.findall(r"([^=&]*)=([^&]*)", query):
            if SECRET_PARAMETER.search(name):
                return f"the parameter {one_line(name, 40)}= in its {scheme}:// URL"
    return None


def _refuse_credentials(words: list[str]) -> None:
    """A password in the command would be in the manifest in clear, in the RayJob anyone who may
    read it sees, and Ray shows a job's command in its dashboard and logs: the pods take
    credentials from the environment, which --secret fills from a Kubernetes Secret. The
    message names the option, never the value."""
    for i, word in enumerate(words):
        found = _credentials(word)
        if found:
            option = (word.partition("=")[0] if word.startswith("--") else
                      words[i - 1] if i and words[i - 1].startswith("--") else f"argument {i + 1}")
            raise ImgtrainError(
                f"the command after -- has credentials in {one_line(option, 60)}: {found}. The manifest would show "
                "them in clear, and Ray shows a job's command to everyone who can see the cluster's jobs: write the "
                "URL without them and give them to the pods from a Kubernetes Secret with --secret: "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for MLflow, AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY for S3 (docs/clusters.md)")


def parse_command(root, words: list[str]) -> Command:
    """Read ``words`` (``train --data ...``) with the CLI's command group ``root`` (typer's click):
    a command that does not parse is refused now, not in a pod after the cluster came up."""
    from typer import TyperException  # typer's own copy of click raises its ClickException, a TyperException

    _refuse_credentials(words)  # first: a message below may quote the word that holds them
    if any(w in ("--help", "-h") for w in words):
        raise ImgtrainError("the command after -- holds --help: give the command to run on the cluster")
    if any(ord(c) < 32 or ord(c) == 127 for w in words for c in w):  # the manifest's comments quote it, line by line
        raise ImgtrainError("the command after -- holds a control character (a newline?): pass plain arguments")
    command, path, rest = root, [], list(words)
    while getattr(command, "commands", None) and rest and not rest[0].startswith("-"):  # a group
        if rest[0] not in command.commands:
            where = " ".join(["imgtrain", *path])
            raise ImgtrainError(f"the command after --: '{where}' has no command {one_line(rest[0], 80)!r}")
        command, path, rest = command.commands[rest[0]], [*path, rest[0]], rest[1:]
    if not path:
        raise ImgtrainError("the command after -- names no imgtrain command: e.g. -- train --data s3://... --name NAME")
    if getattr(command, "commands", None) and not getattr(command, "invoke_without_command", False):
        raise ImgtrainError(f"the command after --: 'imgtrain {' '.join(path)}' needs one of its commands: "
                            f"{', '.join(sorted(command.commands))}")  # its parser would print its help instead
    try:
        params = command.make_context("imgtrain " + " ".join(path), list(rest)).params
    except TyperException as e:
        where = " ".join(["imgtrain", *path])
        raise ImgtrainError(f"the command after -- ({where}): {one_line(e.format_message(), 300)}") from None
    train = _train_config(params) if path == ["train"] else None
    storage = params.get("storage") or (TrainConfig.storage if "storage" in params else None)
    joins = "address" in params and not params["address"]
    return Command(words=tuple(words) + (("--address", "auto") if joins else ()), storage=_text(storage),
                   data=_text(params.get("data")), run_name=_text(params.get("name")), train=train)


def _text(value) -> str | None:
    """An option's value as given (a Path option comes back a Path); None when unset or empty."""
    return str(value) if value not in (None, "") else None


def _train_config(params: dict) -> TrainConfig:
    """The settings a `train` command's flags give, checked as `train` checks them. A --config
    file is read by the pod (its path is the pod's): its settings are not known here."""
    given = {k: v for k, v in params.items() if v is not None and k not in ("config", "overwrite", "quiet", "json_out")}
    if "workers" in given:
        given["min_workers"], given["workers"] = parse_workers(given["workers"])
    cfg = resolve(given)
    if params.get("config") is None:
        validate(cfg)
    return cfg


def default_name(command: Command | None) -> str:
    """imgtrain-{run name}, made a DNS label, or imgtrain."""
    run = re.sub(r"[^a-z0-9-]+", "-", (command.run_name or "").lower()) if command else ""
    return ("imgtrain-" + run)[:MAX_NAME["rayjob"]].strip("-") if run.strip("-") else "imgtrain"


def check(spec: Spec, command: Command | None) -> None:
    """Refuse, in one line, what KubeRay, Kubernetes or the pods would refuse later."""
    problems = _spec_problems(spec)
    if spec.kind == "rayjob" and command is None:
        problems.append("a RayJob runs a command: give it after --, e.g. -- train --data s3://b/data "
                        "--storage s3://b/runs --name NAME")
    if problems:
        raise ImgtrainError("; ".join(problems))
    if command is not None:
        _check_storage(spec, command)
        if command.train is not None and command.train.backend == "ray":
            _check_fit(spec, command.train)


def _spec_problems(spec: Spec) -> list[str]:
    problems = []
    if spec.kind not in KINDS:
        problems.append(f"--kind {one_line(spec.kind, 40)!r} is not one of {', '.join(KINDS)}")
    limit = MAX_NAME.get(spec.kind, min(MAX_NAME.values()))
    if not DNS_1035_LABEL.match(spec.name) or len(spec.name) > limit:
        problems.append(f"--name {one_line(spec.name, 80)!r} must be a DNS-1035 label of at most {limit} characters: "
                        "lower-case letters, digits and '-', starting with a letter and ending with a letter or digit")
    if not spec.image:
        problems.append(f"--image is required: a container image with imgtrain and Ray {spec.ray_version} installed "
                        "(docs/clusters.md shows a Dockerfile)")
    elif any(c.isspace() or ord(c) < 32 for c in spec.image):
        problems.append(f"--image {one_line(spec.image, 80)!r} is not an image reference (it holds spaces)")
    for flag, value, least in (("--pods", spec.pods, 1), ("--cpus-per-pod", spec.cpus_per_pod, 1),
                               ("--gpus-per-pod", spec.gpus_per_pod, 0), ("--head-cpus", spec.head_cpus, 1)):
        if value < least:
            problems.append(f"{flag} must be at least {least}, got {value}")
    for flag, value in (("--memory-per-pod", spec.memory_per_pod), ("--head-memory", spec.head_memory)):
        if not QUANTITY.match(value) or not float(re.match(r"[0-9.]*", value).group() or 0):
            problems.append(f"{flag} {one_line(value, 40)!r} is not an amount of memory in Kubernetes' units, "
                            "such as 8Gi or 512Mi")
    for flag, value in (("--secret", spec.secret), ("--service-account", spec.service_account)):
        if value is not None and not _object_name(value):
            problems.append(f"{flag} {one_line(value, 80)!r} is not a Kubernetes object name (lower-case letters, "
                            "digits, '-' and '.')")
    return problems + _pvc_problems(spec) + _ray_problems(spec)


def _object_name(value: str) -> bool:
    return len(value) <= 253 and bool(DNS_1123_SUBDOMAIN.match(value))


def _pvc_problems(spec: Spec) -> list[str]:
    if spec.mount is None:
        return []
    claim, path = spec.mount
    if not _object_name(claim) or not path.is_absolute() or str(path) != posixpath.normpath(str(path)) \
            or str(path) in ("/", "/dev/shm") or ":" in str(path):
        return [f"--pvc {one_line(spec.pvc, 80)!r}: give CLAIM:/mount/path, a PersistentVolumeClaim's name and "
                "an absolute path to mount it at, e.g. runs-volume:/mnt/shared"]
    return []


def _ray_problems(spec: Spec) -> list[str]:
    if not RAY_VERSION.match(spec.ray_version):
        return [f"--ray-version {one_line(spec.ray_version, 40)!r} is not a version such as 2.60.0"]
    if spec.auth not in AUTH_MODES:
        return [f"--auth {one_line(spec.auth, 40)!r} is not one of {', '.join(AUTH_MODES)}"]
    if spec.auth == "token" and tuple(map(int, spec.ray_version.split("."))) < TOKEN_AUTH_SINCE:
        return [f"--auth token needs Ray {'.'.join(map(str, TOKEN_AUTH_SINCE))} or later (--ray-version "
                f"{spec.ray_version}): use a newer Ray, or --auth none"]
    return []


def _shared(spec: Spec, location: str) -> bool:
    """Whether every pod sees ``location`` (a bucket, or a path on the --pvc volume)."""
    if is_remote(location):
        return True
    path = posixpath.normpath(location.removeprefix("file://"))
    return spec.mount is not None and path.startswith("/") and PurePosixPath(path).is_relative_to(spec.mount[1])


def _check_storage(spec: Spec, command: Command) -> None:
    if command.storage is not None and not _shared(spec, command.storage):
        instead = (f"a path under the --pvc mount {spec.mount[1]}" if spec.mount else
                   "--pvc CLAIM:/mnt/shared (a ReadWriteMany volume) and a --storage under it")
        raise ImgtrainError(f"--storage {one_line(command.storage, 120)} is a path on each pod's own disk, which no "
                            "other pod sees and which goes with its pod: keep runs in s3://bucket/prefix (--secret "
                            f"gives the pods its keys), or on {instead}")
    if command.data and not _shared(spec, command.data):
        warnings.warn(f"--data {one_line(command.data, 120)} is read from each pod's own disk: it must be in the image "
                      "at that path (or in a bucket, or on the --pvc volume)", ImgtrainWarning, stacklevel=2)
    remote = [loc for loc in (command.storage, command.data) if loc and is_remote(loc)]
    if remote and not (spec.secret or spec.service_account):
        warnings.warn(f"{remote[0]}: neither --secret nor --service-account gives the pods credentials for it; "
                      "they need them from their nodes (an instance role)", ImgtrainWarning, stacklevel=2)


def _check_fit(spec: Spec, cfg: TrainConfig) -> None:
    """The command's Ray Train workers on the worker pods (the head holds none): what Ray cannot
    place it waits for forever."""
    if cfg.use_gpu and not spec.gpus_per_pod:
        raise ImgtrainError("the command trains on GPUs (--gpu) but the pods have none: pass --gpus-per-pod N")
    per_pod = int(spec.cpus_per_pod // cfg.cpus_per_worker)
    if cfg.use_gpu:
        per_pod = min(per_pod, spec.gpus_per_pod)
    shape = f"{spec.cpus_per_pod} CPU" + (f" and {spec.gpus_per_pod} GPU" if cfg.use_gpu else "")
    if per_pod * spec.pods < cfg.workers:
        raise ImgtrainError(
            f"{spec.pods} pod(s) of {shape} hold {per_pod * spec.pods} of the command's {cfg.workers} training "
            f"workers ({cfg.cpus_per_worker:g} CPU{' and 1 GPU' if cfg.use_gpu else ''} each): raise --pods or "
            f"{'--gpus-per-pod' if cfg.use_gpu and per_pod == spec.gpus_per_pod else '--cpus-per-pod'}, or lower "
            "the command's --workers")
    from imgtrain.cluster import required_cpus  # the cluster and run store: not for `imgtrain --help`

    needed, total = required_cpus(cfg), spec.pods * spec.cpus_per_pod
    if total < needed:
        raise ImgtrainError(f"{spec.pods} pod(s) of {spec.cpus_per_pod} CPU hold {total} CPUs; the command's "
                            f"{cfg.workers} training workers and Ray Data's reads need {needed:g}: raise --pods or "
                            "--cpus-per-pod")
    if spec.gpus_per_pod and not cfg.use_gpu:
        warnings.warn("the pods have GPUs but the command trains on CPUs: add --gpu to the command after --",
                      ImgtrainWarning, stacklevel=2)


def manifest(spec: Spec, command: Command | None) -> dict:
    """The RayJob (the cluster made for ``command``, gone after it) or the RayCluster alone."""
    cluster = cluster_spec(spec)
    if spec.kind == "raycluster":
        return {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": spec.name}, "spec": cluster}
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": spec.name}, "spec": {
        "entrypoint": command.line(spec.ray_version),  # `ray job submit` of the image's Ray joins it
        "submissionMode": "K8sJobMode",  # KubeRay's default, stated: the path the entrypoint is quoted for
        # the pods cost while they stand; the runs are in the storage, which outlives them
        "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": TTL_AFTER_JOB_S,
        "rayClusterSpec": cluster,
    }}


def cluster_spec(spec: Spec) -> dict:
    """A head pod for the driver and one group of identical worker pods, no autoscaling."""
    out: dict = {"rayVersion": spec.ray_version}
    if spec.auth == "token":  # KubeRay makes the token's Secret and gives it to every Ray container and the submitter
        out["authOptions"] = {"mode": "token"}
    # The head reserves no CPU: Ray Train workers and Ray Data tasks go to the worker pods, whose
    # CPUs the command's plan was checked against; the driver runs on the head all the same.
    out["headGroupSpec"] = {"rayStartParams": {"num-cpus": "0"},
                            "template": _pod(spec, "ray-head", spec.head_cpus, spec.head_memory, 0, HEAD_PORTS)}
    params = {"num-gpus": str(spec.gpus_per_pod)} if spec.gpus_per_pod else {}
    out["workerGroupSpecs"] = [{
        "groupName": "workers", "replicas": spec.pods, "minReplicas": spec.pods, "maxReplicas": spec.pods,
        "rayStartParams": params,
        "template": _pod(spec, "ray-worker", spec.cpus_per_pod, spec.memory_per_pod, spec.gpus_per_pod),
    }]
    return out


def _pod(spec: Spec, name: str, cpus: int, memory: str, gpus: int, ports=()) -> dict:
    """One Ray container's pod: requests equal to limits (Ray sizes itself from them)."""
    limits = {"cpu": str(cpus), "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    container: dict = {"name": name, "image": spec.image,
                       "resources": {"requests": dict(limits), "limits": limits},
                       # Ray's object store and NCCL live in /dev/shm; a container's own is 64 MB
                       "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    if ports:
        container["ports"] = [{"name": port_name, "containerPort": port} for port_name, port in ports]
    if spec.secret:  # every key (AWS_ACCESS_KEY_ID, ...) an environment variable of the driver and the workers
        container["envFrom"] = [{"secretRef": {"name": spec.secret}}]
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if spec.mount:
        claim, path = spec.mount
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": claim}})
        container["volumeMounts"].append({"name": "shared", "mountPath": str(path)})
    pod: dict = {"containers": [container], "volumes": volumes}
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if gpus:  # GPU nodes are often tainted so that only pods asking for GPUs land there
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"spec": pod}


def header(spec: Spec, command: Command | None) -> list[str]:
    """The manifest's opening comment lines: how to apply it, and for a RayCluster how to run
    the command on it."""
    kind = "RayJob" if spec.kind == "rayjob" else "RayCluster"
    lines = [f"{kind} for KubeRay (ray.io/v1), from `imgtrain cluster manifest`. Apply: kubectl apply -f FILE"]
    if spec.kind == "rayjob":
        return lines + [f"The command's output: kubectl logs -f job/{spec.name}; the pods go "
                        f"{TTL_AFTER_JOB_S} s after the job ends (the runs stay in the storage)."]
    lines += ["Then submit commands to it from this machine:",
              f"  kubectl port-forward svc/{spec.name}-head-svc 8265:8265 &"]
    if spec.auth == "token":
        lines.append(f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(kubectl get secret {spec.name} "
                     "-o jsonpath='{.data.auth_token}' | base64 -d)")
    example = "imgtrain train --address auto --storage s3://... --name NAME ..."
    job = command.line(installed_ray()) if command else example  # `ray job submit` here: the Ray beside imgtrain
    return lines + [f"  ray job submit --address http://127.0.0.1:8265 -- {job}"]


def to_yaml(spec: Spec, command: Command | None) -> str:
    """The manifest as YAML, its header as comments: the whole text is one YAML document."""
    import yaml  # here: the CLI reads Spec's options for every --help

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):  # the same dict twice is written twice, never as &id001 / *id001
            return True

    body = yaml.dump(manifest(spec, command), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=10_000)
    return "".join(f"# {line}\n" for line in header(spec, command)) + body
