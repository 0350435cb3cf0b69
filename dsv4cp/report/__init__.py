"""Reports over measurement records: the loader, tables, plots, ``summary.md`` and run comparison.

* ``load``: ``load_runs`` (the only reader of ``records.jsonl`` / ``meta.json``), ``load_trace``.
* ``tables``: DataFrame -> DataFrame (headline, phases, scaling, overlap, memory, imbalance, bound).
* ``diagnosis``: per profiled point and rank, the parts of the traced step (bound, kernel excess, padding,
  imbalance wait, exposed communication, idle) and their cause; ``targets``: the specs' declared targets
  judged; ``parity``: the ``sweep --check`` results.
* ``plots``: DataFrame -> matplotlib Figure (scaling, phases, overlap, memory, bound, packing, cost growth,
  roofline; trace timelines), styled by ``styles`` (a colour and marker per series, legends beside the axes).
* ``growth``, ``roofline``: cost growth with context and the per-phase roofline (table and figure each).
* ``side_by_side``: two runs' matched points in columns with compare's verdict (``report A B``).
* ``sections``: the summary's sections on A vs B, cost growth and memory peaks.
* ``summary``: ``write_report`` (summary.md + tables + plots), used by ``dsv4cp report``.
* ``compare``: baseline vs new run, used by ``dsv4cp compare``.
"""

from dsv4cp.report.load import load_runs, load_trace
from dsv4cp.report.summary import write_report

__all__ = ["load_runs", "load_trace", "write_report"]
