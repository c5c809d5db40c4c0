"""moeserve/bench/quant_gpu.py: the timing of the quantized forms runs and reports every format at every row count
(on a CPU, the ops' CPU twins; the numbers that matter come from a GPU)."""

from moeserve.bench.quant_gpu import main, time_forms


def test_time_forms_reports_each_format_and_row_count(capsys):
    table = time_forms(64, 128, rows=(1, 8), device="cpu", repeats=2)
    assert [(r["format"], r["rows"]) for r in table] == [(f, n) for f in ("int8", "int4", "fp8") for n in (1, 8)]
    assert {r["form"] for r in table} == {"Int8PackLinear", "Int4PackLinear", "Fp8ScaledLinear"}
    assert all(r["form_ms"] > 0 and r["reference_ms"] > 0 for r in table)
    assert main(["--out", "32", "--in", "64", "--rows", "1", "--device", "cpu"]) == 0
    assert "Int4PackLinear" in capsys.readouterr().out
