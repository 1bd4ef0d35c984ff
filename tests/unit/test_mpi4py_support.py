"""The support list of raps_slurm.mpi (raps_slurm/mpi/support.py) is docs/mpi.md's
table, every call on it exists in the MPI namespace and is used by one of the programs
its family names (tests/unit/test_mpi_programs.py runs each of them under Open MPI and
under RAPS), and each call family has a program that loses a rank under RAPS."""

from __future__ import annotations

import re
from pathlib import Path

from raps_slurm.mpi import MPI
from raps_slurm.mpi.support import FAMILIES, table

REPO = Path(__file__).resolve().parents[2]
OWNERS = {"MPI": MPI, "Comm": MPI.Intracomm, "Request": MPI.Request, "Status": MPI.Status,
          "Datatype": MPI.Datatype, "Group": MPI.Group, "Prequest": MPI.Prequest}


def _resolves(call: str) -> bool:
    owner, _, name = call.partition(".")
    obj = OWNERS[owner]
    for part in name.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_docs_mpi_md_shows_the_support_list() -> None:
    doc = (REPO / "docs/mpi.md").read_text()
    assert table() in doc, "docs/mpi.md's support table is not raps_slurm.mpi.support.table()"


def test_every_listed_call_exists_and_a_program_of_its_family_uses_it() -> None:
    missing, unused = [], []
    for f in FAMILIES:
        sources = [(REPO / p).read_text() for p in f.programs]
        for call in (*f.calls, *f.aliases):
            if not _resolves(call):
                missing.append(call)
        for call in f.calls:
            word = re.compile(rf"\b{re.escape(call.rsplit('.', 1)[1])}\b")
            if not any(word.search(s) for s in sources):
                unused.append(f"{f.name}: {call}")
    assert not missing, f"listed but not in raps_slurm.mpi: {missing}"
    assert not unused, f"listed but used by none of the family's programs: {unused}"


def test_names_not_listed_are_refused() -> None:
    # the list is what is supported: a few mpi4py names it leaves out stay unsupported
    for call in ("Comm.Igatherv", "Comm.Neighbor_alltoall", "MPI.Win", "Datatype.Create_darray",
                 "Request.Cancel", "MPI.Op.Create"):
        listed = {c for f in FAMILIES for c in (*f.calls, *f.aliases)}
        assert call not in listed
        assert not _resolves(call), call
