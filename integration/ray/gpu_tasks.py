"""A Ray driver that needs GPUs: N tasks of one GPU each, held for a while, at once.

Usage: gpu_tasks.py ADDRESS N SECONDS. Prints one JSON line per task, then "done": the
node it ran on as the gpush node provider names it (its NODE_ID_AS_RESOURCE if it has
one, else its IP) and the GPU ids Ray gave it.
"""

import json
import sys
import time

import ray


@ray.remote(num_gpus=1, num_cpus=1)
def on_a_gpu(seconds: float) -> dict:
    time.sleep(seconds)
    node_id = ray.get_runtime_context().get_node_id()
    me = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    number = me["Resources"].get("NODE_ID_AS_RESOURCE")
    node = str(int(number)) if number is not None else me["NodeManagerAddress"]
    return {"node": node, "gpu_ids": ray.get_gpu_ids()}


def main() -> None:
    address, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    ray.init(address=address, log_to_driver=False)
    for result in ray.get([on_a_gpu.remote(seconds) for _ in range(count)]):
        print(json.dumps(result), flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
