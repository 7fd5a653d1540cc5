"""A Ray Serve application whose replicas each need a GPU, autoscaled on load (docs/ray.md).

Usage:
  serve_app.py ADDRESS deploy HTTP_HOST HTTP_PORT
      starts Serve (its controller and its one HTTP proxy on the head, at HTTP_HOST:HTTP_PORT)
      and runs the deployment ``Model`` under route ``/``; returns, printing "deployed", once
      its first replica is up, the application then running on without this driver.
  serve_app.py ADDRESS shutdown
      deletes the application and shuts Serve down; prints "shut down".

A request ``GET /?sleep=S`` waits S seconds in the replica and answers JSON: the node the
replica runs on as the gpush node provider names it (its NODE_ID_AS_RESOURCE if it has one,
else its IP), the replica's id and the GPU ids Ray gave it.
"""

import asyncio
import sys
import warnings

import ray
from ray import serve

APP = "gpu-model"


@serve.deployment(
    ray_actor_options={"num_gpus": 1},
    max_ongoing_requests=8,
    autoscaling_config={
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 1,
        "upscale_delay_s": 0,
        "downscale_delay_s": 5,
        # Fast metrics (the defaults are 10 s and 30 s). metrics_interval_s is deprecated in
        # favour of environment variables, which would have to reach the proxy's process.
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
    },
)
class Model:
    def __init__(self):
        node_id = ray.get_runtime_context().get_node_id()
        me = next(n for n in ray.nodes() if n["NodeID"] == node_id)
        number = me["Resources"].get("NODE_ID_AS_RESOURCE")
        self.node = str(int(number)) if number is not None else me["NodeManagerAddress"]
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.gpu_ids = ray.get_gpu_ids()

    async def __call__(self, request) -> dict:
        await asyncio.sleep(float(request.query_params.get("sleep", 0)))
        return {"node": self.node, "replica": self.replica, "gpu_ids": self.gpu_ids}


def main() -> None:
    address, command = sys.argv[1], sys.argv[2]
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # metrics_interval_s
    ray.init(address=address, log_to_driver=False)
    if command == "deploy":
        host, port = sys.argv[3], int(sys.argv[4])
        # One proxy, on the head. By default every node with a replica gets one, and each
        # would bind HTTP_HOST:HTTP_PORT: the test cluster's workers share the head's machine.
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
        serve.run(Model.bind(), name=APP, route_prefix="/")
        print("deployed", flush=True)
    elif command == "shutdown":
        serve.delete(APP)
        serve.shutdown()
        print("shut down", flush=True)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
