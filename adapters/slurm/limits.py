"""Slurm's limit reasons in a user's words.

With accounting enforced (AccountingStorageEnforce=limits,qos), a job can wait because
an association's or a QOS's limit is reached: ``AssocGrpGRES`` (the account's jobs hold
all the GPUs its ``GrpTRES=gres/gpu=N`` allows), ``QOSMaxGRESPerUser``,
``AssocGrpGRESMinutes`` (the account's GPU-minutes budget is spent), and some sixty more.
The names are built from parts (slurm.h's ``job_state_reason``): whose limit (``Assoc``:
the account's association; ``QOS``), what kind (``Grp``: everything the account or QOS
runs together; ``Max``/``Min``: per job, user, account or node), what it counts (``GRES``,
``Cpu``, ``Mem``, ``Node``, ``Jobs``, ``Wall``, ``Billing``, ...) and whether it counts
use now or use over time (``Minutes``, ``RunMinutes``). :func:`limit_reason` reads them
by those parts, so a reason this table has not met still reads sensibly.
"""

from __future__ import annotations

import re

_REASON = re.compile(
    r"(?P<whose>Assoc|QOS)"
    r"(?P<scope>Grp|Max|Min)"
    r"(?P<what>GRES|Cpu|CPU|Mem|Node|Jobs?|SubmitJobs?|Wall|Billing|License|Energy|BB|Tres|TRES)"
    r"(?P<rest>.*)\Z"
)
_WHAT = {
    "GRES": "GPUs",  # the GRES gpush asks for are GPUs (gres/gpu, MIG types) or MPS shares
    "Cpu": "CPUs",
    "CPU": "CPUs",
    "Mem": "memory",
    "Node": "nodes",
    "Job": "running jobs",
    "Jobs": "running jobs",
    "SubmitJob": "queued and running jobs",
    "SubmitJobs": "queued and running jobs",
    "Wall": "run time",
    "Billing": "billing units",
    "License": "licenses",
    "Energy": "energy",
    "BB": "burst buffer",
    "Tres": "resources",
    "TRES": "resources",
}
_PER = {"PerJob": "per job", "PerUser": "per user", "PerAccount": "per account", "PerNode": "per node"}
# Reasons that do not follow the pattern.
_WHOLE = {
    "AssocResourceLimit": "a resource limit of {account}",
    "AssocTimeLimit": "the time limit of {account}",
    "QOSResourceLimit": "a resource limit of {qos}",
    "QOSTimeLimit": "the time limit of {qos}",
    "QOSJobLimit": "the job limit of {qos}",
    "QOSUsageThreshold": "the usage threshold of {qos}",
}


def limit_reason(reason: str, *, cluster: str, account: str = "", qos: str = "") -> str | None:
    """Why a job waits on a Slurm limit, for its user: e.g. for ``AssocGrpGRES``,
    ``"waiting on slurm-a for account nlp's limit on GPUs in use at once (GrpTRES=gres/gpu=N;
    Slurm: AssocGrpGRES): it starts when the account's other jobs free some"``; None for a
    reason that is not a limit (Resources, Priority, ...)."""
    names = {
        "account": f"account {account}" if account else "the account",
        "qos": f"QOS {qos}" if qos else "the QOS",
    }
    said = f"Slurm: {reason}"
    if reason in _WHOLE:
        return f"waiting on {cluster} for {_WHOLE[reason].format(**names)} ({said}): it starts when the limit allows"
    match = _REASON.match(reason)
    if match is None:
        return None
    who = names["account"] if match["whose"] == "Assoc" else names["qos"]
    what = _WHAT[match["what"]]
    rest = match["rest"].removesuffix("Limit")
    run_minutes, minutes = rest.startswith("RunMinutes"), rest.startswith("Minutes")
    per = next((words for key, words in _PER.items() if key in rest), None)
    counted = match["what"] not in ("Job", "Jobs", "SubmitJob", "SubmitJobs", "Wall")
    if run_minutes and counted:
        what = f"{_singular(what)}-minutes of its running jobs"
    elif minutes and counted:
        what = f"{_singular(what)}-minutes used"
    # The sacctmgr setting, for the TRES limits (the ones a GPU job meets): GrpTRES,
    # GrpTRESMins, GrpTRESRunMins, MaxTRESPerJob, MaxTRESPU, MaxTRESPA, MaxTRESPerNode.
    setting = ""
    if counted and match["what"] not in ("Tres", "TRES"):
        tres = (
            "gres/gpu"
            if match["what"] == "GRES"
            else {"Cpu": "cpu", "CPU": "cpu"}.get(match["what"], match["what"].lower())
        )
        suffix = "RunMins" if run_minutes else "Mins" if minutes else ""
        per_key = {"per job": "PerJob", "per user": "PU", "per account": "PA", "per node": "PerNode"}.get(per or "", "")
        setting = f"{match['scope']}TRES{suffix}{per_key}={tres}=N; "
    where = f"({setting}{said})"
    if match["scope"] == "Min":
        return f"the job asks for less than {who}'s minimum of {what} on {cluster} {where}: ask for more"
    if per == "per job":
        return (
            f"the job asks for more than {who}'s limit on {what} per job on {cluster} {where}: it will not start "
            "until the job asks for less or an admin raises the limit"
        )
    if per:
        return f"waiting on {cluster} for {who}'s limit on {what} {per} {where}: it starts when some are free"
    if minutes:
        outlook = "it starts when an admin raises it or the recorded usage decays"
        return f"waiting on {cluster} for {who}'s limit on {what} {where}: {outlook}"
    at_once = "" if run_minutes or not counted else " in use at once"
    holder = "the account's" if match["whose"] == "Assoc" else "the QOS's"
    outlook = (
        f"it starts when {holder} other jobs end" if not counted else f"it starts when {holder} other jobs free some"
    )
    return f"waiting on {cluster} for {who}'s limit on {what}{at_once} {where}: {outlook}"


def _singular(what: str) -> str:
    return {"GPUs": "GPU", "CPUs": "CPU", "nodes": "node", "licenses": "license", "billing units": "billing"}.get(
        what, what
    )
