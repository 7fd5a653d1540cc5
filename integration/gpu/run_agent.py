"""Read this machine's NVIDIA GPUs the way the node agent does, print the report, optionally record NVML.

Needs a real GPU with its driver (libnvidia-ml.so) and nvidia-ml-py. From the repository root:

    .venv/bin/python integration/gpu/run_agent.py                     # the report as JSON
    .venv/bin/python integration/gpu/run_agent.py --record my-node.json  # also write a recording

A recording can go into tests/data/nvml/ (see its README.md); the tests then replay it.
Not a pytest module (no test_ prefix): it needs hardware the test machines do not have.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from broker.nodeagent.agent import collect, mps_control_pipe, proc_comm, record  # noqa: E402
from broker.nodeagent.nvml import PynvmlLibrary, RecordedLibrary, dump_recording  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", default=socket.gethostname().split(".")[0], help="node name (default: hostname -s)")
    parser.add_argument("--record", metavar="FILE", type=Path, help="also write an NVML recording to FILE")
    parser.add_argument("--description", default="", help="what the recording shows (stored in it)")
    args = parser.parse_args(argv)

    library = PynvmlLibrary()
    report = collect(library, args.node, process_name=proc_comm, mps_control=mps_control_pipe)
    print(json.dumps(report.model_dump(mode="json"), indent=2))
    if args.record:
        recording = record(
            library,
            machine=args.node,
            description=args.description or f"recorded on {args.node}",
            source="recorded from real NVML by integration/gpu/run_agent.py",
        )
        args.record.write_text(dump_recording(recording))
        replayed = collect(
            RecordedLibrary(args.record), args.node, process_name=proc_comm, mps_control=mps_control_pipe
        )
        same = replayed.model_dump(exclude={"collected_at"}) == report.model_dump(exclude={"collected_at"})
        print(
            f"wrote {args.record} ({len(recording['calls'])} calls); replays to the same report: {same}",
            file=sys.stderr,
        )
    return 1 if report.error else 0


if __name__ == "__main__":
    sys.exit(main())
