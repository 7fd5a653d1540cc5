"""One reconciled GPU inventory: the view, the finding rules, the agent's report and its storage."""
