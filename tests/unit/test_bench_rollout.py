"""bench/rollout.py's reading of the rollout's output and report, against what today's rollout
writes (the bench itself needs the simulated fleet)."""

from __future__ import annotations

import io
import json
import sys
from collections import Counter

from bench import rollout as bench
from freetoken_infra import report
from freetoken_infra import rollout as product
from freetoken_infra.core.records import Finished, RunRecord


def _batch_output(monkeypatch, index: int, hosts: list[str]) -> tuple[str, product.BatchRun]:
    """What today's rollout prints for a batch, its pyinfra run replaced by a process that writes
    each host's run record (an unchanged host) as the deploy would."""
    records = "\n".join(RunRecord(h, finished=Finished(failed=False, changes=0)).to_json() for h in hosts)
    child = f"import os; open(os.environ[{product.RECORD_ENV!r}], 'a').write({records!r} + '\\n')"
    monkeypatch.setattr(product, "pyinfra_argv", lambda *a, **k: [sys.executable, "-c", child])
    out = io.StringIO()
    batch = product.run_batch(index, hosts, "inventories/sim.py", "deploys/freetoken.py", [], out=out)
    return out.getvalue(), batch


def test_the_batches_and_the_report_are_found_in_todays_output(monkeypatch):
    first, one = _batch_output(monkeypatch, 0, ["ws1"])
    second, two = _batch_output(monkeypatch, 1, ["ws2", "ws3", "ws10"])
    text = first + second + "\n" + report.format_fleet_report(one.rows + two.rows) + "\n"
    marks = [(what, float(i)) for i, line in enumerate(text.splitlines(keepends=True)) if (what := bench.mark(line))]
    assert [what for what, _ in marks] == ["ws1", "ws2, ws3, ws10", "report"], text
    timed = bench.batch_times(marks, wall=100.0)
    assert [hosts for hosts, _ in timed] == ["ws1", "ws2, ws3, ws10"]
    # each batch from its line to the next mark: the first to the second batch's line, the
    # second to the report's
    (_, t1), (_, t2), (_, t3) = marks
    assert timed == [("ws1", t2 - t1), ("ws2, ws3, ws10", t3 - t2)]
    # a batch's end line ("--> rollout batch N ended: ...") starts nothing
    assert bench.mark("--> rollout batch 1 ended: ws1 ok\n") is None


def test_a_rollout_cut_short_times_its_last_batch_to_the_end():
    assert bench.batch_times([("ws1", 2.0)], wall=30.0) == [("ws1", 28.0)]
    assert bench.batch_times([], wall=5.0) == []


def test_the_results_are_counted_from_todays_json_report():
    rows = [
        report.host_row("ws1", [RunRecord("ws1", finished=Finished(failed=False, changes=0))]),
        report.host_row("ws2", [RunRecord("ws2", finished=Finished(failed=False, changes=3))]),
        report.host_row("ws3", [RunRecord("ws3", finished=Finished(failed=True, changes=0))]),
    ]
    doc = json.loads(json.dumps({"stopped": None, "hosts": [r.to_dict() for r in rows]}))
    counts, unchanged = bench.results(doc)
    assert counts == Counter({"ok": 2, "failed": 1}) and unchanged == 1
