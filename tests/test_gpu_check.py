"""benchmarks/gpu_check.py, the script a GPU machine runs, works end to end at tiny sizes on the CPU: it names the
machine and what is installed, and measures the polyp model's float and INT8 inference."""

from __future__ import annotations

import json


def test_the_gpu_check_writes_its_report(tmp_path, one_thread):
    from benchmarks.gpu_check import main

    out = tmp_path / "gpu_check.md"
    assert main(["--smoke", "--sections", "environment", "inference", "--out", str(out)]) == 0
    report = out.read_text()
    assert "| CUDA available |" in report and "| flwr | 1.42.0 |" in report
    rows = [line for line in report.splitlines() if line.startswith(("| float32, CPU", "| INT8, ONNX Runtime"))]
    assert len(rows) == 2 and all(float(row.rsplit("|", 2)[1]) > 0 for row in rows)
    assert json.loads(out.with_suffix(".json").read_text()) == {"environment": "ok", "inference": "ok"}
