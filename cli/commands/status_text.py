"""``ckptrun status``'s words: the document :mod:`ckptrun.cli.commands.status_facts` gathers, as lines.

Importable without torch.
"""

from __future__ import annotations

from typing import Any

from ckptrun.cli.durations import format_duration
from ckptrun.cli.humanize import human_age, human_bytes


def render(doc: dict[str, Any]) -> str:
    lines = [f"run       {doc['run_dir']}" + (f" ({doc['run_id']})" if doc["run_id"] else ""),
             f"state     {_state_words(doc)}",
             f"progress  {_progress_words(doc['progress'])}",
             f"snapshot  {_snapshot_words(doc['snapshot'], doc['plain_script'])}",
             f"RTO       {_rto_words(doc['rto'])}", ""]
    if doc.get("nodes"):
        lines[2:2] = [f"nodes     {_node_words(doc['nodes'])}"]
    if doc.get("tiers_off"):
        lines[-1:-1] = [f"tiers     {t['tier']}: OFF since step {t['step']} of attempt {t['attempt']} ({t['reason']})"
                        for t in doc["tiers_off"]]
    if doc.get("spares"):
        lines[3:3] = ["spares    " + " · ".join(f"spare {s['spare']} pid {s['pid']} on {s['host']}: waiting"
                                              for s in doc["spares"])]
    return "\n".join(lines + _rank_table(doc["ranks"]))


def _node_words(nodes: list[dict[str, Any]]) -> str:
    life = {True: "running", False: "gone", None: "elsewhere"}
    return " · ".join(f"node {n['node']}{' (leader)' if n['node'] == 0 else ''} pid {n['pid']} on {n['host']}: "
                      f"{life[n['alive']]}" for n in nodes)


def _state_words(doc: dict[str, Any]) -> str:
    words = [doc["state"] + (f" (supervisor pid {doc['supervisor_pid']})" if doc["supervisor_pid"] else "")]
    if doc["attempt"] is not None:
        words.append(f"attempt {doc['attempt']}")
    words.append(f"{doc['restarts']} restart(s), {doc['failures']} failure(s)")
    return " · ".join(words)


def _progress_words(p: dict[str, Any]) -> str:
    if p["step"] is None:
        return "no step yet"
    words = [f"step {p['step']}" + (f"/{p['total_steps']}" if p["total_steps"] else "")]
    if p["loss"] is not None:
        words.append(f"loss {p['loss']:.4f}")
    if p["steps_per_s"] is not None:
        words.append(f"{p['steps_per_s']:.2f} steps/s")
    if p["samples_per_s"] is not None:
        words.append(f"{p['samples_per_s']:,.0f} samples/s")
    if p["eta_s"] is not None:
        words.append(f"ETA {format_duration(p['eta_s'])}")
    return " · ".join(words)


def _snapshot_words(s: dict[str, Any] | None, plain: bool) -> str:
    if s is None and plain:
        return ("none by ckptrun (the script does not use ckptrun.runtime: a failure relaunches it, and it resumes "
                "only if it loads its own checkpoint)")
    if s is None:
        return "none yet (a failure now restarts from the beginning)"
    if s.get("check") == "listing":
        return f"unknown: {s['path']} cannot be listed ({'; '.join(s['problems'][:1])})"
    check = "sizes ok" if s["verified"] else f"FAILS the size check ({'; '.join(s['problems'][:2])})"
    return (f"step {s['step']} · {human_age(s['age_s'])} ago · {human_bytes(s['bytes'])} · {check} "
            "(quick check; `ckptrun verify` hashes every byte)")


def _rto_words(r: dict[str, Any]) -> str:
    if r["rto_s"] is None:
        text = "not measured yet (no restart); `ckptrun estimate-rto RUN_DIR` estimates it"
    else:
        parts = " + ".join(f"{name} {format_duration(v)}" for name, v in r["components_s"].items() if v is not None)
        text = f"{format_duration(r['rto_s'])}, median of {r['restarts_measured']} restart(s)" + (f": {parts}" if parts else "")
    if r["budget_s"] is not None:
        verdict = {None: "unknown", True: "within", False: "OVER"}[r["within_budget"]]
        text += f" · budget {format_duration(r['budget_s'])}: {verdict}"
    return text


def _rank_table(ranks: list[dict[str, Any]]) -> list[str]:
    if not ranks:
        return ["no heartbeats yet (ranks starting; a script without ckptrun.runtime beats from its first optimizer step)"]
    many = any("node" in r for r in ranks)
    rows = [("RANK", *(("NODE",) if many else ()), "PID", "ALIVE", "PHASE", "STEP", "HEARTBEAT", "STEPS/S", "FLAGS")]
    for r in ranks:
        rate = "n/a" if r["steps_per_s"] is None else f"{r['steps_per_s']:.2f}"
        node = (str(r["node"]) if r.get("node") is not None else "?",) if many else ()
        rows.append((str(r["rank"]), *node, str(r["pid"]), {True: "yes", False: "no", None: "?"}[r["alive"]], r["phase"],
                     str(r["step"]), f"{human_age(r['heartbeat_age_s'])} ago", rate, ",".join(r["flags"]) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
