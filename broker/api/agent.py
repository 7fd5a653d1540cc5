"""The route node agents (``gpush agent``) report their GPUs to; only an agent or an
admin token may call it. The answer carries the MIG layouts the broker wants on the node's
GPUs now (``mig``). Reading the reports back is broker.api.inventory's.
"""

from typing import Any

from fastapi import APIRouter

from broker.api.deps import Agent, AppClock, Db
from broker.api.responses import AUTH, BODY, errors
from broker.core import auth
from broker.fleet import mig_changes
from broker.inventory import report_store as nodereports
from broker.inventory.agent_report import NodeReport

router = APIRouter(tags=["inventory"], responses=errors(*AUTH))


@router.post("/v1/agent/reports", status_code=202, responses=errors(403, *BODY))
def agent_report(report: NodeReport, session: Db, who: Agent, clock: AppClock) -> dict[str, Any]:
    """A node agent's view of its GPUs (gpush agent); the newest per node is kept."""
    auth.check_may_report(who, report.node)  # an agent token reports for its own nodes only
    with session.begin():
        row = nodereports.save_report(session, report, by=who.user, now=clock())
        # MIG layouts the broker wants on this node's GPUs now (broker.fleet.mig_changes):
        # an agent started with --allow-mig-changes makes them and reports again.
        wanted = mig_changes.wanted_by_agent(session, report.node)
        return {"node": row.node, "collected_at": row.collected_at, "received_at": row.received_at, "mig": wanted}
