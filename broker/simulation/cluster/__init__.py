"""The simulated cluster: one cluster of a fleet file behind the adapter protocol, in virtual time.

This package owns :class:`SimulatedCluster`, the first implementation of the adapter
protocol (:mod:`broker.core.adapter`): when jobs start and end, their status log, and
the state file. It drives the embedded demo, the tests and trace replays, so from the
broker's side it behaves like a real cluster, only far faster than real time. The
fleet file it is built from is :mod:`broker.simulation.fleet`; what a submission must
satisfy, and how long a job runs, is :mod:`broker.simulation.admission`; how units are
counted, handed out and reported is :mod:`broker.simulation.pools`.

As the Slurm and Kubernetes adapters, it is a thin adapter class
(:mod:`~broker.simulation.cluster.adapter`) whose calls each go to the one concern that
owns them, all sharing one :class:`~broker.simulation.cluster.state.ClusterState`:
``engine`` (virtual time: jobs start, end and queue), ``jobs`` (submit, cancel, preempt,
find, scale), ``status`` (status pages and cursors), ``nodes`` (fencing), ``mig`` (MIG
layouts), ``logs`` (a job's output), ``capacity`` (inventory and health),
``virtual_time`` (advance, next event, outage) and ``persistence`` (the state file and
the lock every call holds).

How a simulated cluster behaves (what a broker or a test may rely on):

- **Virtual time.** Every public call first advances the cluster to ``clock()``. Jobs
  end at their exact virtual end time, and waiting jobs start at the virtual time the
  units they wait for freed, not at the time of the call. :meth:`SimulatedCluster.advance`
  and :meth:`SimulatedCluster.next_event_time` let a replay jump from event to event.
- **Node choice.** A placement's ``node`` is honoured (the job waits there if the node
  is busy). Without one, the job takes the first node, in fleet-file order, with room.
  Under MPS and time-slicing a placement's ``gpus`` (one device index per replica, or
  one for all of them; only with a ``node``) are honoured too: each replica runs on its
  GPU, and the job waits in the node's queue until those GPUs have room, behind the
  jobs there that want the same GPUs (or any GPU), not behind those pinned to others.
  Whole GPUs and MIG instances are counted per node, not per device, so ``gpus`` is
  ignored there.
- **Queueing.** Jobs wait in FIFO order, without backfill: per node for jobs pinned to a
  node, and per unit kind across the cluster for the others. Units on a node where
  pinned jobs wait go to no unpinned job until those have started, so a large job is
  not starved by small ones. A multi-unit job takes all its units on one node at once, or waits.
  Replicas (``placement.replicas``) are placed together on one node.
- **Multi-node jobs.** A placement with several ``nodes`` (whole GPUs or MIG slices)
  takes ``units`` on each of them at once, only when every one has room and no job
  pinned there waits first, else it waits whole (gangs oldest first) and starts
  nowhere; its ranks end together. Its status is one job whose node is the comma list
  of its nodes; ``logs(replica=RANK)`` is rank RANK's output (ranks per node: the
  spec's ``tasks_per_node``).
- **Time-slicing OOM.** There is no memory isolation: when the ``gpu_memory_gb`` of the
  jobs on one physical GPU adds up to more than the GPU has, the job that pushed it over
  fails with ``OOMKilled: time-sliced GPU memory over-committed`` (exit code 137), as a
  CUDA allocation would; the jobs already there keep running.
- **Status.** ``statuses(cursor)`` returns every change since the cursor, in order, each
  at its virtual time; without a cursor (or with one from a cluster whose state was
  lost) it returns every known job's current state.
- **Persistence, shared.** With ``state_file``, jobs, allocations and the status log are
  written there (JSON) after every call that changed them and reloaded on start, so a
  simulated cluster outlives a broker restart as a real one does. The file is the
  cluster: several broker processes on one database (API replicas, the leader and the
  one that takes over when it dies) each have an instance, and every call holds an
  exclusive lock on ``<state_file>.lock`` and first reloads the file when another
  instance wrote it since, so no instance acts on, or writes back, a stale view. Without
  that, an API replica's health check overwrote the leader's jobs and a new leader
  never learnt of the jobs the old one had submitted (they stayed ``submitted`` for
  good, holding their tenant's share).
- **Preemption.** A simulated job told of a preemption (:meth:`SimulatedCluster.preempt`)
  saves its state and exits 0 at once, as a program that checkpoints on its signal does.
- **Fencing.** A fenced node (:meth:`SimulatedCluster.fence`, Slurm's drain) starts no
  new job: jobs pinned to it wait there, saying so, and the others go to other nodes or
  wait; its running jobs go on, and its inventory shows its units taken, with why (as a
  drained Slurm node or a cordoned Kubernetes one). Unfenced, it takes the
  jobs that wait for it at once.
- **MIG layouts.** As Slurm is told of a GPU a node agent re-cut:
  :meth:`SimulatedCluster.publish_mig` gives a GPU in MIG mode a new layout at once, and
  waiting jobs may start on the new instances. As MIG instances are counted per node and
  profile (see Node choice), a change is refused while the node's running jobs hold more
  instances of a profile than the node would have, or while jobs wait for a profile no
  node would have any more. Published layouts and fences are kept in the state file, so
  they outlive a restart.
- **Not simulated:** CPU and host memory on nodes (reported in the file, not enforced),
  partitions, node failures.
"""

from broker.simulation.cluster.adapter import SimulatedCluster

__all__ = ["SimulatedCluster"]
