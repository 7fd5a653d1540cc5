"""Ray: the autoscaler node provider backed by gpush, its workers, and Ray jobs."""
