"""Plain-text reports: one findings table per host, one summary per fleet."""

from __future__ import annotations

import shutil
import textwrap
from typing import Iterable

from freetoken_infra.rules import Finding

_MARK = {"pass": "pass", "warn": "WARN", "block": "BLOCK"}


def findings_table(host_name: str, findings: Iterable[Finding]) -> str:
    findings = list(findings)
    width = max(100, min(shutil.get_terminal_size((140, 20)).columns, 180))
    check_w = max(len("check"), *(len(f.check) for f in findings)) if findings else 5
    status_w = 6
    text_w = max(30, width - check_w - status_w - 6)
    lines = [f"== {host_name}: preflight ==", f"{'check':<{check_w}}  {'status':<{status_w}}  evidence / remedy"]
    lines.append("-" * min(width, check_w + status_w + 4 + text_w))
    for f in findings:
        body = textwrap.wrap(f.evidence, text_w) or [""]
        if f.remedy and f.status != "pass":
            body += textwrap.wrap("-> " + f.remedy, text_w, subsequent_indent="   ")
        lines.append(f"{f.check:<{check_w}}  {_MARK[f.status]:<{status_w}}  {body[0]}")
        lines += [f"{'':<{check_w}}  {'':<{status_w}}  {rest}" for rest in body[1:]]
    return "\n".join(lines)


def fleet_summary(results: dict[str, list[Finding]]) -> str:
    lines = ["== fleet preflight summary =="]
    name_w = max([4, *(len(n) for n in results)])
    for name in sorted(results):
        findings = results[name]
        blocked = [f.check for f in findings if f.status == "block"]
        warned = [f.check for f in findings if f.status == "warn"]
        verdict = "BLOCKED" if blocked else "ready"
        detail = ""
        if blocked:
            detail += " blockers: " + ", ".join(blocked)
        if warned:
            detail += " warnings: " + ", ".join(warned)
        lines.append(f"{name:<{name_w}}  {verdict:<7}{detail}")
    ready = sum(1 for f in results.values() if not any(x.status == "block" for x in f))
    lines.append(f"{ready} of {len(results)} host(s) ready")
    return "\n".join(lines)
