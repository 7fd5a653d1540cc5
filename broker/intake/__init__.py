"""Job intake: submitting to the global queue, the job store, job files."""
