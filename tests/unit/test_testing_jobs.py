"""``raps_slurm.testing.jobs``' judgement of a job's end, without a cluster: only the last
``final`` line of the output is the job's result."""

from __future__ import annotations

from pathlib import Path

from raps_slurm.testing.jobs import heat_reference, last_final, result_problem, unpaced

CLEAN = "final aa bb cc dd"
OTHER = "final aa bb cc 00"


def test_the_last_final_line_bare_or_labelled() -> None:
    assert last_final(f"step 1\n{CLEAN}\nraps-run: all 4 ranks finished\n") == CLEAN
    assert last_final(f"{CLEAN}\nraps-run: requeued\n{OTHER}\n") == OTHER
    assert last_final(f" 0: {OTHER}\n10: step 3\n") == f" 0: {OTHER}"
    assert last_final("finalize done\nstep 1\n") is None
    assert last_final("") is None


def test_a_completed_job_passes_only_with_the_clean_line_last() -> None:
    assert result_problem("COMPLETED", f"{OTHER}\n{CLEAN}\n", CLEAN) is None
    # the clean line somewhere is not enough: the requeued run's result came after it
    assert result_problem("COMPLETED", f"{CLEAN}\n{OTHER}\n", CLEAN) == \
        f"its last final line is {OTHER!r}, not {CLEAN!r}"
    assert result_problem("COMPLETED", "step 1\n", CLEAN) == \
        f"its last final line is None, not {CLEAN!r}"
    assert result_problem("COMPLETED", f"0: {CLEAN}\n", f"0: {CLEAN}") is None


def test_a_job_that_did_not_complete_fails_whatever_it_printed() -> None:
    for state in ("FAILED", "NODE_FAIL", "CANCELLED", "TIMEOUT"):
        assert result_problem(state, f"{CLEAN}\n", CLEAN) == f"the job ended {state}"


def test_a_program_whose_result_line_has_another_first_word_is_judged_by_it() -> None:
    """An mpi4py program prints ``tasks ...``: its last such line is its result."""
    clean, other = "tasks 240 sum 125940 digest 46", "tasks 240 sum 125940 digest 00"
    text = f"raps-run: rank 3 epoch 2 started on n2\n{clean}\nraps-run: all 4 ranks finished\n"
    assert result_problem("COMPLETED", text, clean) is None
    assert result_problem("COMPLETED", f"{clean}\n{other}\n", clean) == \
        f"its last tasks line is {other!r}, not {clean!r}"
    assert result_problem("COMPLETED", "raps-run: all 4 ranks finished\n", clean) == \
        f"its last tasks line is None, not {clean!r}"


def test_a_reference_run_drops_only_the_pace() -> None:
    """heat_ring's result does not depend on ``--step-sec``: the reference runs without it."""
    assert unpaced(["--steps", "5", "--step-sec", "5.0", "--every", "3"]) == \
        ["--steps", "5", "--every", "3"]
    assert unpaced(("--steps", "9", "--step-sec=0.05")) == ["--steps", "9"]
    assert unpaced(["--steps", "240", "--every", "20"]) == ["--steps", "240", "--every", "20"]


def test_a_reference_is_computed_once_for_its_ranks_and_arguments(tmp_path: Path) -> None:
    """The pace is no part of it; the ranks and every other argument are."""
    args = ["--steps", "6", "--every", "3"]
    first = heat_reference(tmp_path / "a", 2, args)
    assert first.startswith("final ") and len(first.split()) == 3, first
    assert (tmp_path / "a" / "ref").is_dir()  # the local launcher's run directory
    assert heat_reference(tmp_path / "b", 2, [*args, "--step-sec", "0.5"]) == first
    assert not (tmp_path / "b").exists()  # not run again
    other = heat_reference(tmp_path / "c", 2, ["--steps", "7", "--every", "3"])
    three = heat_reference(tmp_path / "d", 3, args)
    assert (tmp_path / "c" / "ref").is_dir() and (tmp_path / "d" / "ref").is_dir()
    assert len({first, other}) == 2 and len(three.split()) == 4, (first, other, three)
