"""``imgtrain serve``: a checkpoint's model behind HTTP, with Ray Serve: the deployment and the
server's lifecycle. The HTTP API itself (the routes, the replica) is ``routes.py``; what a request
may be, ``requests.py``.

The driver finds and verifies the checkpoint, refuses a busy port before starting Ray, deploys
``ModelServer`` with its queues sized from ``Limits``, waits for the app with a deadline, then
blocks until SIGINT or SIGTERM and shuts Serve and Ray down. With one replica on a cluster it
starts, the replica answers HTTP itself (``--ingress direct``, Serve's direct ingress): Serve's
proxy and router cost about 6 ms of CPU per request here, most of what a batched request costs.
"""

import contextlib
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

from ray import serve

from imgtrain import cluster as cluster_mod
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.inference.export_engine import check_engine, read_export
from imgtrain.inference.options import INGRESS, TTA, Limits, ServeOptions
from imgtrain.inference.predictor import check_tta, preprocess_preset
from imgtrain.inference.requests import RETRY_AFTER_S
from imgtrain.inference.routes import REPLICA_CPUS, ModelServer
from imgtrain.ops.files import link_dir
from imgtrain.storage import runs

APP_NAME = "imgtrain"
STARTUP_TIMEOUT_S = 180.0  # Ray + Serve + model load: ~45 s on 2 busy cores; past this, stuck
PROXY_GRACE_S = 5.0  # Ray's proxy gives up this long after the replica's own timeout: a backstop only


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress (a feature flag in Ray 2.60): the replica's own HTTP server
    listens on ``port``, with no proxy actor in between. Serve's proxy and router cost about 6 ms of
    CPU per request on 2 cores (a model-free app: 250 req/s through them, 1,370 direct; BENCHMARKS.md),
    the ceiling that held the batched server at 3.7-3.9x one client's rate. The flags are read when
    Ray's processes import Serve, so they go into a private cluster's environment; the port range
    is this one port (the range's end is exclusive), and no draining period is kept for a load
    balancer that is not there."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def choose_ingress(ingress: str, replicas: int, joins_cluster: bool) -> str:
    """``direct`` where it works (one replica on a cluster this command starts), else ``proxy``."""
    if ingress not in INGRESS:
        raise ImgtrainError(f"--ingress must be one of {', '.join(INGRESS)}, got {ingress!r}")
    if ingress == "direct" and (replicas != 1 or joins_cluster):
        why = ("--replicas is more than 1 (each replica would need a port of its own)" if replicas != 1 else
               "it joins a running cluster, whose processes were started without Serve's direct-ingress flag")
        raise ImgtrainError(f"--ingress direct needs one replica on a Ray cluster imgtrain starts, but {why}; "
                            "use --ingress proxy")
    if ingress == "auto":
        return "proxy" if replicas != 1 or joins_cluster else "direct"
    return ingress


# ---------------------------------------------------------------- the driver


def run_server(run, checkpoint: str = ServeOptions.checkpoint, storage: str = ServeOptions.storage,
               host: str = ServeOptions.host, port: int = ServeOptions.port, limits: Limits = Limits(),
               replicas: int = ServeOptions.replicas, address: str | None = ServeOptions.address,
               openapi: bool = ServeOptions.openapi, ingress: str = ServeOptions.ingress, announce=print,
               tta: str = ServeOptions.tta, engine: str = ServeOptions.engine, ood_score: str = ServeOptions.ood_score,
               reject: str | None = ServeOptions.reject) -> None:
    """Serve the checkpoint until SIGINT or SIGTERM; returns after a clean shutdown. ``tta="flip"``:
    each answer's probabilities are averaged over the image and its mirror image (``Predictor``).
    ``engine="onnxruntime"``: ``run`` is an ONNX export folder, served with ONNX Runtime.
    ``ood_score``: each answer's out-of-distribution score; ``reject``: ``auto`` or a threshold
    under which an image is answered ``unknown`` (``predictor.rejection``)."""
    import ray

    ingress = choose_ingress(ingress, replicas, joins_cluster=address is not None or ray.is_initialized())
    path, logs = _check_request(run, checkpoint, storage, host, port, limits, replicas, tta, engine)
    threshold = _threshold(path, engine, ood_score, reject)
    private_env = direct_ingress_env(port) if ingress == "direct" else None
    stop = _StopSignals()
    terminal = sys.stdout  # ray_session swaps sys.stdout for a log file; announce needs the real one
    with stop.listening():  # from before Ray starts: a signal during startup shuts down too
        try:
            with cluster_mod.ray_session(address, replicas * REPLICA_CPUS, logs, "serve.log",
                                          private_env=private_env) as cluster:
                stop.listen()  # ray.init replaced our SIGTERM handler with its sys.exit(15)
                if stop.is_set():  # Ctrl-C while Ray started
                    return
                link_dir(logs / "ray-serve", cluster.session_logs)
                try:
                    # Serve starts its proxy with direct ingress too: it gets a port of its own.
                    proxy_port = free_port(host) if ingress == "direct" else port
                    _deploy(path, host, proxy_port, limits, replicas, openapi, tta, engine, ood_score, threshold)
                    if _wait_ready(host, port, stop, logs):
                        with contextlib.redirect_stdout(terminal):
                            via = "the replica answers directly" if ingress == "direct" else \
                                "through Ray Serve's proxy"
                            explain = "POST /explain, " if engine == "torch" else ""  # an export has no maps
                            announce(f"serving {path} at {_url(host, port, connect=False)} (POST /predict, "
                                     f"{explain}GET /healthz; {via}); Ctrl-C stops")
                            terminal.flush()  # seen at once through a pipe or a log file too
                        while not stop.wait(1.0):  # a timed wait: signal handlers run promptly
                            pass
                finally:
                    _stop_serve(joined=address is not None)
        except SystemExit as e:  # ray.init's own SIGTERM handler: a stop during startup
            if e.code != signal.SIGTERM:
                raise


def _check_request(run, checkpoint, storage, host, port, limits, replicas, tta="none",
                   engine="torch") -> tuple[Path, Path]:
    """(the verified checkpoint, where logs go), after every check that can fail before Ray starts."""
    problems = limits.problems()
    if tta not in TTA:
        problems.append(f"--tta must be one of {', '.join(TTA)}, got {tta!r}")
    if not 0 < port < 65536:
        problems.append(f"--port must be 1..65535, got {port}")
    if replicas < 1:
        problems.append(f"--replicas must be at least 1, got {replicas}")
    if problems:
        raise ImgtrainError("; ".join(problems))
    # Verified here: a damaged checkpoint (or export) fails in one line, not in a replica's log.
    check_engine(engine, run)
    if engine != "torch":  # an export: its checksums here; the engine's model only in the replica
        read_export(run, engine)
        path = Path(run)
    else:
        path = runs.resolve_checkpoint(run, checkpoint, storage)
    check_tta(tta, preprocess_preset(path))  # flip on a digits model: a warning, once, here
    check_port_free(host, port)
    in_run = (path.parent / runs.CONFIG_FILE).is_file()  # a checkpoint inside a run directory
    logs = path.parent / runs.LOGS_DIR if in_run else cluster_mod.user_log_dir()
    logs.mkdir(parents=True, exist_ok=True)
    return path, logs


def _threshold(path: Path, engine: str, ood_score: str, reject) -> float | None:
    """``--reject``'s threshold, or None, and the score's own needs checked: before Ray starts, so a
    bad value fails in one line."""
    from imgtrain.inference.export_engine import read_record
    from imgtrain.inference.predictor import check_score, rejection, score_method
    from imgtrain.storage.checkpoint import read_meta

    meta = read_record(path) if engine != "torch" else read_meta(path)
    method = score_method(engine, ood_score, meta)
    check_score(path, meta, method)
    return rejection(path, meta, method, reject)


def _deploy(path: Path, host: str, port: int, limits: Limits, replicas: int, openapi: bool, tta: str,
            engine: str, ood_score: str = "energy", threshold: float | None = None) -> None:
    from ray.serve.config import BackpressureConfig

    serve.start(http_options={"host": host, "port": port,
                              "request_timeout_s": limits.request_timeout_s + PROXY_GRACE_S})
    _check_http_config(host, port)
    # The replica refuses requests past its own queue (ModelServer.predict), so Ray's router must let
    # them reach it: a replica at Serve's max_ongoing_requests makes the router retry with backoffs of
    # up to 0.5 s, which at 256 clients left the replica idle and the answers 15 s late (BENCHMARKS.md).
    # Serve's own queue in the proxy (503 with the same Retry-After) is a backstop for floods past that.
    # max_ongoing_requests also caps the bodies being read at once, which the replica does not count.
    per_replica = limits.max_queued_requests + limits.max_batch_size
    app = ModelServer.options(
        num_replicas=replicas,
        max_ongoing_requests=2 * per_replica,
        max_queued_requests=per_replica * replicas,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S),
    ).bind(str(path), limits, cluster_mod.threads_for(replicas), openapi, tta, engine, ood_score, threshold)
    serve.run_many([serve.RunTarget(app, name=APP_NAME)], wait_for_applications_running=False)


class _StopSignals(threading.Event):
    """Set by SIGINT or SIGTERM; a second Ctrl-C stops waiting for the clean shutdown."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def _on_signal(self, *_):
        if self.is_set():
            raise KeyboardInterrupt
        self.set()

    def listen(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._on_signal)

    @contextlib.contextmanager
    def listening(self):
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.listen()
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def check_port_free(host: str, port: int) -> None:
    """Bind the port ourselves first: Serve's proxy would otherwise fail in a log file, unseen."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ImgtrainError(f"cannot listen on host {host!r}: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            s.bind(sockaddr)
        except OSError as e:
            raise ImgtrainError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                                "is another server using it? pick another --port") from None


def free_port(host: str) -> int:
    """A port nothing listens on now, from the kernel."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(sockaddr)
        return s.getsockname()[1]


def _check_http_config(host: str, port: int) -> None:
    """On a joined cluster, Serve may already run with other HTTP options, which win silently."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    if (config.host, config.port) != (host, port):
        raise ImgtrainError(f"Ray Serve already runs on this cluster at {config.host}:{config.port}; "
                            f"pass --host {config.host} --port {config.port} or use another cluster")


def _wait_ready(host: str, port: int, stop: threading.Event, logs: Path) -> bool:
    """True once /healthz answers through the proxy; False if stopped; an error on failure or timeout."""
    url = f"{_url(host, port)}/healthz"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not stop.is_set():
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == "DEPLOY_FAILED":
            detail = one_line(app.message, 100_000)[-300:]  # the end says what failed
            raise ImgtrainError(f"the model replica failed to start: {detail} (logs: {logs})")
        if app is not None and app.status == "RUNNING":
            with contextlib.suppress(OSError):
                with opener.open(url, timeout=2) as r:
                    if r.status == 200:
                        return True
        if time.monotonic() > deadline:
            raise ImgtrainError(f"the server did not answer on {url} within {STARTUP_TIMEOUT_S:.0f} s "
                                f"(application status: {app.status if app else 'not deployed'}); logs: {logs}")
        stop.wait(0.25)
    return False


def _stop_serve(joined: bool) -> None:
    """Take our app down; on a cluster that was joined, leave Serve to the other apps there."""
    with contextlib.suppress(Exception):  # already down, or the cluster went away: nothing to clean
        if joined:
            serve.delete(APP_NAME)
            if serve.status().applications:
                return
        serve.shutdown()


def _url(host: str, port: int, connect: bool = True) -> str:
    """The server's base URL; to connect, a wildcard host means this machine's loopback."""
    if connect and host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1" if host != "::" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
