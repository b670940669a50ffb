"""The lease's test groups are the whole gpu suite: scripts/h200_session.sh's ``tests`` phase runs
``make test-gpu``'s set as one process per group (its default list of names), and its record stands for
the suite only if no ``gpu`` test falls between the groups.

Read statically from the script (its case arms ``name) ... part NAME "$limit" ARGS``, the ``for set in
...`` loops expanded): every file holding a ``gpu`` test lies under some kernel group's paths, or is the
end-to-end module, every test of which (as pytest collects it on this CPU) some end-to-end group selects by
``::name`` or its ``-k`` expression (pytest's own, matched against the test's id).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from _pytest.mark.expression import Expression

REPO = Path(__file__).resolve().parents[1]
SCRIPT = (REPO / "scripts" / "h200_session.sh").read_text()
E2E = "tests/deploy/test_serve_gpu_e2e.py"
# make test-gpu's --ignore'd modules hold no gpu test (Makefile's GPU_SUITE)
IGNORED = {"tests/deploy/test_helm_chart.py", "tests/deploy/test_ray_two_nodes.py"}


def default_names() -> list[str]:
    m = re.search(r'names=\$\{WITH_TESTS:-([^}]*)\}', SCRIPT)
    assert m, "the tests phase's default list of names is gone from h200_session.sh"
    return m.group(1).split()


def tiny_test_arms() -> dict[str, str]:
    """tiny_test's case arms: name -> its text up to ``;;``."""
    body = SCRIPT[SCRIPT.index("tiny_test() {"):]
    body = body[:body.index("\n  esac")]
    arms = {}
    for m in re.finditer(r"^  ([a-z0-9-]+)\) (.*?);;", body, re.M | re.S):
        arms[m.group(1)] = m.group(2)
    return arms


def group_args(arm: str) -> list[list[str]]:
    """The pytest arguments of each ``part`` an arm starts (a ``for set in ...`` loop expanded)."""
    loop = re.search(r"for set in ([^;]*); do", arm)
    sets = loop.group(1).split() if loop else [None]
    out = []
    for line in re.findall(r'part \S+ "\$limit" (.*?)(?:\\\n|$|\n)', arm.replace("\\\n", " ")):
        for s in sets:
            text = line if s is None else line.replace("$set", s)
            out.append(shlex.split(text.replace("$e2e", E2E)))
    return out


def gpu_test_files() -> set[str]:
    files = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel not in IGNORED and re.search(r"pytest\.mark\.gpu\b", path.read_text()):
            files.add(rel)
    return files


def e2e_ids() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          E2E], cwd=REPO, capture_output=True, text=True, timeout=300)
    ids = [line.strip() for line in out.stdout.splitlines() if line.startswith(E2E + "::")]
    assert ids, out.stdout[-2000:] + out.stderr[-2000:]
    return ids


def selects(args: list[str], node_id: str) -> bool:
    """Whether pytest ARGS select the end-to-end test NODE_ID (its file, or ``::name``, then ``-k``)."""
    paths = [a for a in args if a.startswith("tests/")]
    if not any(node_id == p or node_id.startswith(p + "::") or (p == E2E and node_id.startswith(E2E)) for p in paths):
        return False
    if "-k" in args:
        expr = Expression.compile(args[args.index("-k") + 1])
        name = node_id.split("::", 1)[1]
        return expr.evaluate(lambda word, **kwargs: word.lower() in name.lower())
    return True


def test_every_gpu_test_is_in_one_of_the_tests_phase_groups():
    arms = tiny_test_arms()
    names = default_names()
    assert set(names) <= set(arms), f"names without a tiny_test arm: {set(names) - set(arms)}"
    groups = {name: group_args(arms[name]) for name in names if name != "demo"}
    assert all(groups.values()), {n: a for n, a in groups.items() if not a}

    kernel_paths = [a for name, runs in groups.items() if name.startswith("kernels-") for args in runs
                    for a in args if a.startswith("tests/")]
    uncovered = {f for f in gpu_test_files() - {E2E}
                 if not any(f == p or f.startswith(p.rstrip("/") + "/") for p in kernel_paths)}
    assert not uncovered, f"gpu tests in no kernel group of h200_session.sh's tests phase: {sorted(uncovered)}"

    e2e_runs = [args for name, runs in groups.items() if not name.startswith("kernels-") for args in runs]
    missed = [i for i in e2e_ids() if not any(selects(args, i) for args in e2e_runs)]
    assert not missed, f"end-to-end gpu tests no group of the tests phase selects: {missed}"


def test_the_reading_can_fail():
    """The reading sees a gap: a -k that selects one greedy case leaves the other out, a path list
    without tests/layers leaves its files out."""
    ids = [f"{E2E}::test_greedy_output_is_the_same_without_speculation_and_in_eager_mode[spec_off]",
           f"{E2E}::test_greedy_output_is_the_same_without_speculation_and_in_eager_mode[eager_mode]"]
    one = [E2E, "-k", "greedy and spec_off"]
    assert [selects(one, i) for i in ids] == [True, False]
    assert not selects([f"{E2E}::test_scripted_checkpoint_with_mtp_and_parsers_on_cuda_graphs"], ids[0])
    arms = tiny_test_arms()
    assert [E2E, "-k", "decode_cuts and neither"] in group_args(arms["cuts-sets"])
    kernel_c = group_args(arms["kernels-c"])[0]
    assert "tests/layers" in kernel_c and "tests/layers/test_router_topk.py" in gpu_test_files()
