"""srun's options read as srun reads them, so raps-run sees what srun would see.

srun parses its command line with GNU ``getopt_long``: a long option may be shortened to
any prefix no other option shares (``--lab`` is ``--label``), short flags combine
(``-lK`` is ``-l -K``, ``-lN4`` is ``-l -N 4``), a required value follows ``=``, is
attached (``-N4``) or is the next word, and an optional one only follows ``=`` or is
attached. :func:`parse` reads options that way, with :data:`LONG` and :data:`SHORT`:
srun's own tables, read off the srun of Slurm 22.05 (``tests/unit/test_srun_options.py``
checks them against the installed srun). A word it cannot read (an option this table
does not know, e.g. from a newer srun, or a prefix several options share) is left as it
is, for srun to accept or refuse. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Arg = Literal["none", "req", "opt"]  # getopt's no_argument, required_, optional_argument

_REQ = """accel-bind account acctg-freq bb bbf bcast-exclude begin chdir cluster
cluster-constraint clusters comment constraint container context core-spec
cores-per-socket cpu-bind cpu-freq cpu_bind cpus-per-gpu cpus-per-task deadline delay-boot
dependency distribution epilog error exclude export extra-node-info gid gpu-bind gpu-freq
gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags het-group hint input
job-name jobid licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu
mincpus mpi msg-timeout network nodefile nodelist nodes ntasks ntasks-per-core
ntasks-per-gpu ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode output
pack-group partition power prefer priority profile prolog qos relative reservation signal
slurmd-debug sockets-per-node switches task-epilog task-prolog tasks-per-node thread-spec
threads threads-per-core time time-min tmp uid wait wckey"""
_OPT = """bcast compress exclusive immediate kill-on-bad-exit nice no-kill overlap propagate
resv-ports send-libs x11"""
_NONE = """contiguous debugger-test disable-status exact help hold interactive label
multi-prog no-allocate overcommit oversubscribe preserve-env pty quiet quit-on-interrupt
reboot spread-job test-only unbuffered usage use-min-nodes verbose version whole"""

LONG: dict[str, Arg] = {
    **dict.fromkeys(_REQ.split(), "req"), **dict.fromkeys(_OPT.split(), "opt"),
    **dict.fromkeys(_NONE.split(), "none")}

# Names srun takes for the same option: a prefix shared only by them is not ambiguous.
ALIASES = {"cluster": "clusters", "cpu_bind": "cpu-bind", "pack-group": "het-group",
           "tasks-per-node": "ntasks-per-node"}

SHORT = {
    "A": "account", "B": "extra-node-info", "C": "constraint", "D": "chdir",
    "E": "preserve-env", "F": "nodefile", "G": "gpus", "H": "hold", "I": "immediate",
    "J": "job-name", "K": "kill-on-bad-exit", "L": "licenses", "M": "clusters",
    "N": "nodes", "O": "overcommit", "Q": "quiet", "S": "core-spec", "T": "threads",
    "V": "version", "W": "wait", "X": "disable-status", "Z": "no-allocate", "b": "begin",
    "c": "cpus-per-task", "d": "dependency", "e": "error", "h": "help", "i": "input",
    "k": "no-kill", "l": "label", "m": "distribution", "n": "ntasks", "o": "output",
    "p": "partition", "q": "qos", "r": "relative", "s": "oversubscribe", "t": "time",
    "u": "unbuffered", "v": "verbose", "w": "nodelist", "x": "exclude"}


@dataclass(frozen=True)
class Option:
    """One option as srun reads it: its long name (None: not read, left to srun) and
    value."""

    name: str | None
    value: str | None = None

    def words(self) -> list[str]:
        """The option written out in full (``--name=value``)."""
        assert self.name is not None
        return [f"--{self.name}" if self.value is None else f"--{self.name}={self.value}"]


@dataclass(frozen=True)
class Group:
    """The words of the command line that gave ``options`` (``-lN4``: label, nodes=4)."""

    words: tuple[str, ...]
    options: tuple[Option, ...]


def long_name(text: str) -> str | None:
    """The option ``--text`` names: an exact name, or a prefix of one option's names only;
    None if none or several."""
    if text in LONG:
        return ALIASES.get(text, text)
    found = {ALIASES.get(n, n) for n in LONG if n.startswith(text)}
    return found.pop() if len(found) == 1 else None


def parse(words: Sequence[str], own: Sequence[str] = ()) -> list[Group]:
    """Read srun options ``words`` (what comes before ``--``) into groups of options;
    ``own`` are long flags without a value that srun does not have (``mpi4py``), matched
    whole. A word that is not an option, or an option srun's table does not read (with
    the next word, unless that is an option), is a group whose one option has no name.
    ValueError if an option that needs a value ends the words."""
    out: list[Group] = []
    i = 0
    while i < len(words):
        word, i = words[i], i + 1
        if word.startswith("--") and len(word) > 2:
            text, eq, value = word[2:].partition("=")
            name = text if text in own and not eq else long_name(text)
            kind = "none" if text in own else LONG.get(name or "", "none")
            if name is None or (kind == "none" and eq):
                group, i = _unread(word, words, i, bool(eq))
                out.append(group)
            elif kind == "req" and not eq:
                if i >= len(words):
                    raise ValueError(f"srun option {word!r} needs a value")
                out.append(Group((word, words[i]), (Option(name, words[i]),)))
                i += 1
            else:
                out.append(Group((word,), (Option(name, value if eq else None),)))
        elif word.startswith("-") and len(word) > 1:
            group, i = _short(word, words, i)
            out.append(group)
        else:
            out.append(Group((word,), (Option(None),)))
    return out


def _short(word: str, words: Sequence[str], i: int) -> tuple[Group, int]:
    """The group of short flags ``word`` starts (and its value's word, if apart), and
    the index after it."""
    options: list[Option] = []
    for k, letter in enumerate(word[1:], 1):
        name = SHORT.get(letter)
        if name is None:
            return _unread(word, words, i, len(word) > 2)
        kind, rest = LONG[name], word[k + 1:]
        if kind == "none":
            options.append(Option(name))
            continue
        if rest or kind == "opt":
            options.append(Option(name, rest or None))
            return Group((word,), tuple(options)), i
        if i >= len(words):
            raise ValueError(f"srun option {word!r} needs a value")
        options.append(Option(name, words[i]))
        return Group((word, words[i]), tuple(options)), i + 1
    return Group((word,), tuple(options)), i


def _unread(word: str, words: Sequence[str], i: int, has_value: bool) -> tuple[Group, int]:
    """An option the table does not read, as one group with the next word if that is not
    an option and ``word`` holds no value (``--new-option value``)."""
    if not has_value and i < len(words) and not words[i].startswith("-"):
        return Group((word, words[i]), (Option(None),)), i + 1
    return Group((word,), (Option(None),)), i


def unparse(groups: Sequence[Group], drop: set[str]) -> list[str]:
    """The words of ``groups`` without the options named in ``drop``: a group that lost
    none keeps its words as the user wrote them, the rest of one that did is written in
    full."""
    out: list[str] = []
    for g in groups:
        if not any(o.name in drop for o in g.options):
            out += g.words
            continue
        for o in g.options:
            if o.name not in drop:
                out += o.words()
    return out
