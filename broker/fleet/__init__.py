"""Changes to the fleet itself, carried out: MIG layout changes and nodes lent between two
clusters, and the preemption that empties a node for either.

Each is a database state machine (a row written before anything is touched, a step per
cycle, resumable after a broker restart) that the scheduling cycle drives. What to change
is decided elsewhere, and purely: MIG layouts in broker.mig (plan, layouts, matching),
which node moves where in broker.placement.lending. This package sits above those and
below broker.scheduling; it never imports the cycle.

- broker.fleet.mig_changes: asking for MIG changes, reading them, their findings
- broker.fleet.mig_steps: moving each change in flight on, one step a cycle
- broker.fleet.lending: a lending pool's nodes settled to one side, each move carried on
- broker.fleet.eviction: jobs preempted for a fleet change, and how any victim is told
"""
