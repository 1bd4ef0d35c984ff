"""rapsctl bench restart's reading of a job's output (pure): the pre-fault step and when
the restarted program got back to it."""

from __future__ import annotations

import pytest

from raps_slurm.bench.restart import final_line, plate, progress
from raps_slurm.errors import BenchError

OUT = """raps-run: step 1: 4 ranks on n1,n3,n5,n6
progress 1 100.0
progress 2 101.0
progress 3 102.0
some MPI error text
raps-run: step 2: 4 ranks on n1,n2,n3,n5
restored step 2
progress 3 110.0
progress 4 111.5
final step 4 residual 1.5 hash 00
"""


def test_caught_up_is_the_first_step_after_the_restart_at_the_pre_fault_step() -> None:
    got = progress(OUT, 102.5)
    assert got == {"pre_fault_step": 3, "restored_step": 2, "running_s": 7.5,
                   "caught_up_s": 7.5, "failure_free_step_s": 1.0, "redo_steps": 0,
                   "redo_s": 0.0, "redo_speed": None}
    # steps printed after the crash, before the program stopped, are lost work too
    later = OUT.replace("some MPI error text", "progress 4 103.0")
    assert progress(later, 102.5)["pre_fault_step"] == 4
    assert progress(later, 102.5)["caught_up_s"] == 9.0
    # steps 3 and 4 again in 1.5 s after the first (110.0): one step of the 1 s pace
    redone = progress(later, 102.5)
    assert (redone["redo_steps"], redone["redo_s"]) == (1, 1.5)
    assert redone["redo_speed"] == pytest.approx(1.0 / 1.5, abs=1e-4)


def test_an_output_without_a_restart_or_without_the_step_again_is_an_error() -> None:
    with pytest.raises(BenchError, match="no restart"):
        progress("progress 1 1.0\nprogress 2 2.0\n", 1.5)
    with pytest.raises(BenchError, match="never printed step 3 again"):
        progress("progress 3 1.0\nrestored step 2\nprogress 2 5.0\n", 1.5)


def test_the_plate_holds_the_state_per_rank_and_the_final_line_is_found() -> None:
    nx, ny = plate(256 << 20)
    assert (nx // 4) * ny * 8 == 256 << 20
    assert final_line(OUT) == "final step 4 residual 1.5 hash 00"
