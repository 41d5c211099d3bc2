"""Ray Serve's own ceiling on this machine (issue 23): a FastAPI ingress that answers at once.

The same HTTP path as ``imgtrain serve`` (Serve's proxy, the router, a replica behind
``@serve.ingress``; or with ``--ingress direct`` the replica's own HTTP server, as ``imgtrain
serve`` runs one replica) with no model and no decoding, loaded like ``serve_load.py``: what no
model server built on Serve can exceed here.

    .venv/bin/python bench/serve_ceiling.py [--ingress proxy|direct] [--replicas 1] [--levels 1:200,16:600,64:1000]
"""

# No ``from __future__ import annotations``: FastAPI must see the ``Request`` annotation itself.
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ray  # noqa: E402
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402
from imgtrain.inference.serve import direct_ingress_env  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from ray import serve  # noqa: E402
from serve_load import free_port, load, test_digits  # noqa: E402

app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=256)
@serve.ingress(app)
class Noop:
    @app.post("/predict")
    async def predict(self, request: Request):
        await request.body()
        return {"index": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ingress", choices=("proxy", "direct"), default="proxy")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--levels", default="1:200,16:600,64:1000")
    args = parser.parse_args()
    ensure_data(SAMPLE_DATA)
    pngs, _, _ = test_digits(SAMPLE_DATA)
    port = free_port()
    result = {"environment": environment(), "inputs": vars(args), "levels": {}}
    if args.ingress == "direct":  # read by Ray's processes as they start: set before ray.init
        os.environ.update(direct_ingress_env(port))
    ray.init(num_cpus=4, log_to_driver=False)
    try:  # with direct ingress, Serve's proxy still starts: on a port of its own
        serve.start(http_options={"host": "127.0.0.1", "port": free_port() if args.ingress == "direct" else port})
        serve.run(Noop.options(num_replicas=args.replicas).bind(), name="ceiling")
        load(port, pngs, 4, 40)
        for level in args.levels.split(","):
            concurrency, requests = (int(v) for v in level.split(":"))
            results, wall = load(port, pngs, concurrency, requests)
            result["levels"][concurrency] = rate = sum(r["status"] == 200 for r in results) / wall
            print(f"{concurrency} concurrent clients: {rate:.0f} req/s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"results: {write_result('serve_ceiling', result)}")


if __name__ == "__main__":
    main()
