"""The whole CI gate against a head whose sparse_attn phase is 60% slower on purpose (the step about 20%
slower): the scratch copy of the package that tests/test_ci_gate.py builds, at the gate's defaults.
Exit status and output are the gate's; run it beside a plain run to see red turn green.

    python results/2026-12-03-cpu-gate-ab/slowed_head.py --base HEAD --skip-sweep --json slowed.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_ci_gate import _slowed_copy, gate  # noqa: E402

with tempfile.TemporaryDirectory(prefix="dsv4cp-slowed-") as folder:
    sys.exit(gate.main([*sys.argv[1:], "--head-tree", str(_slowed_copy(Path(folder)))]))
