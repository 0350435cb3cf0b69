"""Every ``dsv4cp`` command the README and docs/ show runs for real, not only parses (test_readme.py checks
that): each is run in this process, in the docs' order, in one scratch directory, so what one command writes
(``runs/smoke``, ``traces/cp1``, ``calibration.json``) is what the next one the docs show reads.

To run on CPU at small sizes, a command runs through its entry of :data:`SHOWN`, a table keyed by the command
exactly as shown: :class:`Run` lists the substitutions (a tiny preset, few tokens, one timed step, a reduced
copy of the sweep spec); :class:`NotRun` says why the command cannot run here (a GPU, torchrun with several
ranks, nsys). A command the docs show that the table does not list fails the test, as does an entry the docs
no longer show."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dsv4cp.cli.main import main
from test_readme import USER_DOCS, _cli_argv, _shell_commands

ROOT = Path(__file__).resolve().parents[1]

TINY = {"--preset": "tiny", "--tokens": "256"}
"""The tiny preset at a few tokens: the flash preset's code paths at a size a CPU runs in milliseconds."""
ONE_STEP = {"--warmup": "0", "--reps": "1"}
"""No warm-up and one timed step: the command's whole output and record, its timing meaningless."""
TINY_SPEC_TOKENS = 128


@dataclass(frozen=True)
class Run:
    """Run the shown command with ``flags`` set (replaced when shown, added when not), the words of
    ``words`` replaced (a spec or a run directory; ``{tiny}`` is the folder of reduced specs), under the
    environment variables the shown command sets; it must exit 0."""

    flags: dict[str, str] = field(default_factory=dict)
    words: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NotRun:
    """A shown command that cannot run on this machine, and why."""

    reason: str


TORCHRUN = "needs torchrun with several ranks on GPUs (nccl)"
TINY_SPEC = "{tiny}"
SMOKE = {"sweeps/smoke.yaml": f"{TINY_SPEC}/smoke.yaml"}
CPU_TRACE = str(ROOT / "tests" / "data" / "cpu-smoke-trace")
"""A 2-rank CPU trace of a smoke point: what the torchrun profile the guide shows leaves in traces/."""

SHOWN: dict[str, Run | NotRun] = {
    # README.md
    "dsv4cp env": Run(),
    "dsv4cp sweep sweeps/smoke.yaml --out runs/smoke --profile": Run(words=SMOKE),
    "dsv4cp report runs/smoke": Run(),
    "dsv4cp layer --preset tiny --ratio 4 --tokens 4096 --backward": Run({**TINY, **ONE_STEP}),
    "dsv4cp check-cp --cp 4 --ratio 4 --packing histogram --tokens 4096": Run({"--cp": "2", "--tokens": "256"}),
    "dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 2": Run(),  # the analytic model: as shown
    # the run before a change: here the smoke run itself, whose every point matches (exit 0: no regression)
    "dsv4cp compare runs/smoke-base runs/smoke": Run(words={"runs/smoke-base": "runs/smoke"}),
    "torchrun --nproc-per-node 2 -m dsv4cp sweep sweeps/cp_scaling.yaml --out runs/cp_scaling": NotRun(TORCHRUN),
    "dsv4cp report runs/cp_scaling": NotRun("reads the run of the torchrun sweep above"),
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id sweep1 --rdzv-backend c10d --rdzv-endpoint node0:29500 -m "
    "dsv4cp sweep sweeps/cp_scaling.yaml --out runs/cp_scaling_2x8": NotRun("needs two nodes of 8 GPUs"),
    "torchrun --nproc-per-node 2 -m dsv4cp profile --dist-backend nccl --preset flash --ratio 4 --tokens 65536 "
    "--backward --trace-dir traces/ --out runs/profile": NotRun(TORCHRUN),
    # docs/guide/check.md
    "dsv4cp check-cp --cp 3 --ratio 8 --lengths 5,127,0,300 --tokens 432 --recompute": Run(
        {"--lengths": "5,27,0,40", "--tokens": "72"}),
    "dsv4cp check-cp --cp 4 --ratio 4 --packing histogram --tokens 4096 --loss dense --overlap none": Run(
        {"--cp": "2", "--tokens": "256"}),
    "torchrun --nproc-per-node 2 -m dsv4cp check-cp --dist-backend nccl --preset flash --ratio 4 --tokens 16384 "
    "--packing histogram --dtype bf16": NotRun(TORCHRUN),
    "dsv4cp check-determinism --cp 2 --lengths 5,127,0,168 --ties": Run({"--lengths": "5,27,0,32", "--replays": "1"}),
    "torchrun --nproc-per-node 2 -m dsv4cp check-determinism --dist-backend nccl --preset flash --ratio 4 "
    "--tokens 16384 --packing histogram --dtype bf16 --kernel-backend triton-deterministic --deterministic":
        NotRun(TORCHRUN),
    # docs/guide/compare.md
    "dsv4cp sweep sweeps/kernels.yaml --out runs/kernels-new": Run(
        words={"sweeps/kernels.yaml": f"{TINY_SPEC}/kernels.yaml"}),
    "dsv4cp compare results/baselines/h200/kernels runs/kernels-new": NotRun(
        "the baseline was measured on an H200: a run on other hardware is refused (exit 2) by design"),
    # docs/guide/kernels.md: the Triton kernels run on CPU only in their interpreter (~30 s at the tiny
    # preset); the torch backend takes the same options, which are checked and recorded all the same
    "dsv4cp layer --preset flash --ratio 4 --tokens 65536 --backward --dtype bf16 --kernel-backend triton "
    "--kernel-option=topk_impl=stream --kernel-option=triton_dq_in_dkv=0": Run(
        {**TINY, **ONE_STEP, "--kernel-backend": "torch"}),
    "DSV4CP_TOPK_IMPL=stream DSV4CP_TRITON_DQ_IN_DKV=0 dsv4cp layer --preset flash --ratio 4 --tokens 65536 "
    "--backward --dtype bf16 --kernel-backend triton": Run({**TINY, **ONE_STEP, "--kernel-backend": "torch"}),
    # docs/guide/model.md
    "dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 8 --packing histogram --partition balanced": Run(),
    "dsv4cp predict results/runs/h200x2-overlap results/2026-12-01-h200x2-cp2-after-fixes/profile "
    "--machine h200x2": Run(),
    "dsv4cp predict results/runs/h200x2-overlap --machine internode --bandwidth 40": Run(),
    # the profile, its calibration and the balanced model at one point: all three tiny
    "dsv4cp profile --preset flash --ratio 4 --tokens 65536 --backward --dtype bf16 --trace-dir traces/cp1": Run(
        {**TINY, **ONE_STEP}),
    "dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 1 --calibrate traces/cp1 --indexer-scan prefix "
    "--calibration-out calibration.json": Run(TINY),
    "dsv4cp model --preset flash --ratio 4 --tokens 65536 --cp 2 --partition balanced --calibration "
    "calibration.json": Run(TINY),
    "torchrun --nproc-per-node 2 -m dsv4cp profile --dist-backend nccl --preset flash --ratio 4 --tokens 65536 "
    "--backward --dtype bf16 --partition balanced --calibration calibration.json": NotRun(TORCHRUN),
    # docs/guide/profile.md
    "dsv4cp layer --preset flash --ratio 4 --tokens 8192 --backward --progress on": Run({**TINY, **ONE_STEP}),
    "torchrun --nproc-per-node 2 -m dsv4cp profile --dist-backend nccl --preset flash --ratio 4 --tokens 65536 "
    "--backward --overlap async --trace-dir traces/ --out runs/profile": NotRun(TORCHRUN),
    "dsv4cp overlap traces/ --csv overlap.csv": Run(words={"traces/": CPU_TRACE}),
    "dsv4cp profile --preset flash --ratio 4 --tokens 65536 --backward --dtype bf16 --memory-phases": Run(
        {**TINY, **ONE_STEP}),
    "dsv4cp profile --preset flash --ratio 4 --tokens 65536 --backward --dtype bf16 --cuda-graph": NotRun(
        "CUDA graphs need a CUDA device"),
    "dsv4cp profile --preset flash --ratio 4 --tokens 262144 --backward --dtype bf16 --partition balanced "
    "--calibration results/baselines/h200/calibration.json --cp 8 --emulate-rank all --out runs/emulated": Run(
        {**TINY, **ONE_STEP}),
    "dsv4cp profile --preset flash --ratio 4 --tokens 1048576 --backward --dtype bf16 --cp 64 --emulate-rank "
    "0,31,63": Run({"--preset": "tiny", "--tokens": "1024", **ONE_STEP}),
    "nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx,nccl -o dsv4cp torchrun "
    "--nproc-per-node 2 -m dsv4cp profile --dist-backend nccl --preset flash --ratio 4 --tokens 65536 --backward "
    "--nsys-steps 3": NotRun("needs nsys and GPUs"),
    "dsv4cp overlap dsv4cp.sqlite": NotRun("reads the nsys capture above"),
    # docs/guide/report.md: two runs of the docs stand in for the base and the new run
    "dsv4cp report runs/base runs/new --out cmp/": Run(
        words={"runs/base": "results/baselines/cpu-ci/smoke", "runs/new": "runs/smoke"}),
    # docs/guide/sweep.md
    "dsv4cp sweep sweeps/packing.yaml --dry-run": Run(),
    "dsv4cp sweep sweeps/smoke.yaml --out runs/smoke --resume": Run(words=SMOKE),
}


def _shown() -> list[tuple[str, list[str]]]:
    """(command as shown, its words) of every ``dsv4cp`` command of the user docs, in the docs' order, once."""
    seen: dict[str, list[str]] = {}
    for doc in USER_DOCS:
        for command in _shell_commands((ROOT / doc).read_text()):
            if _cli_argv(command) is not None:
                seen.setdefault(shlex.join(command), command)
    return list(seen.items())


def test_the_table_lists_every_shown_command_and_only_those():
    shown = [text for text, _ in _shown()]
    missing = [text for text in shown if text not in SHOWN]
    stale = [text for text in SHOWN if text not in shown]
    assert not missing, "add to SHOWN (a Run with its substitutions, or a NotRun saying why):\n" + "\n".join(missing)
    assert not stale, "the docs no longer show these; drop them from SHOWN:\n" + "\n".join(stale)


def _substituted(argv: list[str], run: Run, tiny: Path) -> list[str]:
    words = [run.words.get(word, word).replace(TINY_SPEC, str(tiny)) for word in argv]
    for flag, value in run.flags.items():
        if flag in words:
            words[words.index(flag) + 1] = value
        else:
            words += [flag, value]
    return words


def _tiny_spec(name: str, into: Path) -> None:
    """``sweeps/<name>`` at the tiny preset (a few tokens when it was another), one timed step, the first
    value of every axis but cp (every degree kept: the sweep spawns its ranks once and runs each)."""
    spec = yaml.safe_load((ROOT / "sweeps" / name).read_text())
    spec["run"] = {**spec.get("run", {}), "warmup": 0, "reps": 1}
    if spec["base"].get("preset") != "tiny":  # a tiny spec keeps its tokens
        spec["base"] = {**spec["base"], "preset": "tiny", "tokens": TINY_SPEC_TOKENS}
        spec["axes"].pop("tokens", None)
    spec["axes"] = {axis: values if axis == "cp" else values[:1] for axis, values in spec["axes"].items()}
    spec.pop("exclude", None)
    (into / name).write_text(yaml.safe_dump(spec))


def test_every_shown_command_runs(tmp_path, monkeypatch, capsys, single_process):
    tiny = tmp_path / "tiny-specs"
    tiny.mkdir()
    for name in ("smoke.yaml", "kernels.yaml"):
        _tiny_spec(name, tiny)
    work = tmp_path / "work"
    work.mkdir()
    for shared in ("sweeps", "results"):  # the inputs the docs name, read-only
        (work / shared).symlink_to(ROOT / shared)
    monkeypatch.chdir(work)
    failed = []
    for text, command in _shown():
        run = SHOWN[text]
        if isinstance(run, NotRun):
            continue
        argv = _substituted(_cli_argv(command), run, tiny)
        with monkeypatch.context() as env:
            for word in command[:command.index("dsv4cp")]:
                env.setenv(*word.split("=", 1))
            code = main(argv)
        out = capsys.readouterr()
        if code != 0:
            failed.append(f"{text}\n  ran as: dsv4cp {shlex.join(argv)}\n  exit {code}: {out.err[-1500:]}")
    assert not failed, "\n".join(failed)
