"""The ``lockstep`` workload (stealer/bench/lockstep.py): every system against the oracle.

Each system (stealer agents, the one-process loop, the process-per-agent pipe design, a
ProcessPoolExecutor shipping the state) runs the tiny size of both configurations; its final
environment states and last observations must equal the one-process oracle's, so a reply
given to the wrong agent, a lost or a repeated call fails.  The check itself is shown to catch
exactly those (a system that swaps two replies, one that drops a call).  Then the wiring
through ``stealer bench --workloads lockstep``.  No timing assertions: the numbers are checked
for presence and sanity only.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path
from typing import Any

import pytest

import stealer
from stealer.bench import cli as bench_cli
from stealer.bench import lockstep as L
from stealer.cli import main

WORKERS = 2
CONFIGS = [L.config_for(c, "tiny") for c in L.CONFIGS]


def _sane(res: dict[str, Any], cfg: L.Config, *, workers: bool, migrations: bool,
          within_w: bool = True) -> None:
    """Keys present, numbers sane; ``within_w``: the handlers ran on at most W cores (not
    the pipes' N processes, which may use every core of a bigger machine)."""
    assert res["calls"] == cfg.agents * cfg.rounds
    assert res["calls_per_s"] > 0 and res["wall_s"] > 0
    assert 0 < res["of_ideal"] < 1.5
    assert res["handler_share"] > 0 and (res["handler_share"] <= 1.0 or not within_w)
    assert 0 < res["round_p50_ms"] <= res["round_p99_ms"]
    assert res["handler_us"] > 0
    assert isinstance(res["client_us"], float)
    assert isinstance(res["worker_us"], float) if workers else res["worker_us"] is None
    assert ("migrations_per_1k" in res) is migrations
    if migrations:  # (stealer: its counters too)
        assert res["spin_us"] >= 0
        assert res["busy_us"] == pytest.approx(res["worker_us"] - res["spin_us"])
        assert res["migrations"] >= 0
        assert res["migrations_per_1k"] == pytest.approx(res["migrations"] / res["calls"] * 1e3)
    assert len(res["finals"]) == len(res["last_obs"]) == cfg.agents
    assert [f[0] for f in res["finals"]] == [cfg.warmup + cfg.rounds] * cfg.agents


@pytest.fixture(scope="module")
def oracles() -> dict[str, dict[str, Any]]:
    return {c.name: L.run_sequential(c, L.calibrate(c.work_s), WORKERS) for c in CONFIGS}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_system_equals_the_oracle(cfg: L.Config, oracles: dict[str, Any]) -> None:
    cal = L.calibrate(cfg.work_s)
    oracle = oracles[cfg.name]
    _sane(oracle, cfg, workers=False, migrations=False)
    pipes = L.run_pipes(cfg, cal, WORKERS)  # forks: before any executor of this test
    _sane(pipes, cfg, workers=True, migrations=False, within_w=False)
    with cf.ProcessPoolExecutor(WORKERS) as ex:
        shipped = L.run_shipped(ex, cfg, cal, WORKERS)
    _sane(shipped, cfg, workers=True, migrations=False)
    with stealer.Executor(WORKERS) as ex:
        agents = L.run_agents(ex, cfg, cal, WORKERS)
    _sane(agents, cfg, workers=True, migrations=True)
    for name, res in [("pipes", pipes), ("shipped", shipped), ("stealer", agents)]:
        L.check(name, res, oracle)
    # the observations are not all alike: an oracle that ignored its inputs would pass
    assert len(set(oracle["last_obs"])) == cfg.agents


def _broken_sequential(cfg: L.Config, fault: str) -> dict[str, Any]:
    """The one-process loop with one fault in round 3: two replies swapped, or a call lost
    (the agent's previous observation returned instead)."""
    cal = L.calibrate(cfg.work_s)
    envs = [L.Env(i, cfg.seed) for i in range(cfg.agents)]
    rounds = [0]

    def step(actions: list[Any]) -> list[tuple[Any, float]]:
        rounds[0] += 1
        if rounds[0] == 3 and fault == "lost":
            out = [(envs[0].obs, 0.0)]
            out += [e.act(a, cal.iters) for e, a in zip(envs[1:], actions[1:])]
            return out
        out = [e.act(a, cal.iters) for e, a in zip(envs, actions)]
        if rounds[0] == 3 and fault == "swapped":
            out[0], out[1] = out[1], out[0]
        return out

    sysm = L.System(step, lambda: [(e.summary(), e.cpu_ns) for e in envs],
                    handlers_in_client=True)
    return L.drive(cfg, cal, sysm, WORKERS)


@pytest.mark.parametrize("fault", ["swapped", "lost"])
def test_check_catches_a_swapped_reply_and_a_lost_call(fault: str,
                                                      oracles: dict[str, Any]) -> None:
    cfg = CONFIGS[0]
    with pytest.raises(RuntimeError, match="differ from the one-process oracle"):
        L.check(fault, _broken_sequential(cfg, fault), oracles[cfg.name])


class _Ref:
    def __init__(self, k: int, log: list[Any]) -> None:
        self.k, self.log = k, log

    def call(self, method: str, *args: Any) -> cf.Future[Any]:
        self.log.append(("call", self.k, method, args))
        f: cf.Future[Any] = cf.Future()
        f.set_result((self.k, args))
        return f


class _BatchExecutor:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def call_all(self, refs: list[_Ref], method: str, args: list[tuple]) -> list[Any]:
        self.log.append(("call_all", method, len(refs)))
        return [r.call(method, *a) for r, a in zip(refs, args)]


@pytest.mark.parametrize("batch", [False, True])
def test_stealer_round_uses_call_all_when_there_is_one(batch: bool) -> None:
    log: list[Any] = []
    refs = [_Ref(k, log) for k in range(3)]
    ex = _BatchExecutor(log) if batch else object()
    got = L.stealer_round(ex, refs, "act", ["a", "b", "c"])
    assert got == [(0, ("a",)), (1, ("b",)), (2, ("c",))]  # replies in agent order
    assert (log[0] == ("call_all", "act", 3)) is batch
    assert [e for e in log if e[0] == "call"] == [
        ("call", k, "act", (a,)) for k, a in enumerate("abc")]


def _logged_system(cfg: L.Config, log: list[str], name: str) -> L.System:
    """The one-process loop as a System that logs each round it steps under ``name``."""
    envs = [L.Env(i, cfg.seed) for i in range(cfg.agents)]

    def step(actions: list[Any]) -> list[Any]:
        log.append(name)
        return [e.act(a, 1) for e, a in zip(envs, actions)]

    return L.System(step, lambda: [(e.summary(), e.cpu_ns) for e in envs],
                    handlers_in_client=True)


def test_interleave_takes_turns_block_by_block_and_steps_each_system_alike() -> None:
    """Warm-up rounds, then blocks in turn, A B then B A: a load change on the machine
    falls on both; each system's rounds are its own, as a system run alone."""
    cfg = L.Config("x", agents=3, work_s=1e-4, rounds=8, warmup=1)
    log: list[str] = []
    got = L.interleave(cfg, {"a": _logged_system(cfg, log, "a"),
                             "b": _logged_system(cfg, log, "b")}, blocks=4)
    assert "".join(log) == "a" + "b" + "aa" + "bb" + "bb" + "aa" + "aa" + "bb" + "bb" + "aa"
    assert got["a"]["rounds"] == got["b"]["rounds"] == 8
    assert len(got["a"]["block_calls_per_s"]) == 4 and got["a"]["calls_per_s"] > 0
    alone = L.drive(cfg, L.Calibration(1e-4, 1, 1e-4), _logged_system(cfg, [], "c"), 1)
    assert got["a"]["last_obs"] == got["b"]["last_obs"] == alone["last_obs"]
    with pytest.raises(ValueError, match="block"):
        L.interleave(cfg, {"a": _logged_system(cfg, [], "a")}, blocks=0)


def test_the_benchmark_script_interleaves_stealer_and_the_pipes() -> None:
    """benchmarks/lockstep.py's interleaved run (L.stealer_vs_pipes), at the tiny size:
    both alive at once (the pipes forked before the executor), the same rounds, a ratio
    and one per block."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "lockstep.py"
    spec = importlib.util.spec_from_file_location("_lockstep_script", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = CONFIGS[0]
    res = script.run_config(cfg, WORKERS, blocks=2)
    assert res["failed"] == []
    got = res["interleaved"]
    assert got["rounds"] == cfg.rounds // 2 * 2 and len(got["block_ratios"]) == 2
    assert got["stealer_vs_pipes"] == pytest.approx(
        got["stealer_calls_per_s"] / got["pipes_calls_per_s"])


def test_ideal_is_ceil_balanced() -> None:
    cfg = L.Config("x", agents=5, work_s=1e-3, rounds=1, warmup=0)
    cal = L.Calibration(1e-3, 10, 2e-3)  # the measured handler time counts, not the target
    got = L.ideal(cfg, cal, workers=2)
    assert got["round_p50_ms"] == pytest.approx(3 * 2.0)  # ceil(5 / 2) handlers per round
    assert got["calls_per_s"] == pytest.approx(5 / 6e-3)


def test_bench_cli_lockstep(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--tiny", "--workloads", "lockstep", "--systems", "stealer,process",
               "--no-plots", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    labels = [label for _k, label, _s in L.table_rows()]
    for label in ("32x0.5ms: calls/s", "256x0.05ms: of ideal", "32x0.5ms: pipes: of ideal"):
        assert label in labels
        assert any(line.startswith("lockstep") and label in line for line in text.splitlines())
    doc = json.loads(out.read_text())
    assert doc["meta"]["errors"] == {}
    res = doc["results"]["lockstep"]
    st, pp = res["systems"]["stealer"], res["systems"]["process"]
    for prefix in L.PREFIXES.values():
        for r in (st, pp):
            assert r[prefix + "calls_per_s"] > 0 and 0 < r[prefix + "of_ideal"] < 1.5
        assert st[prefix + "migrations_per_1k"] >= 0 and pp[prefix + "migrations_per_1k"] is None
        assert st[prefix + "pipes_calls_per_s"] > 0 and st[prefix + "seq_calls_per_s"] > 0
        assert st[prefix + "vs_pipes"] == pytest.approx(
            st[prefix + "calls_per_s"] / st[prefix + "pipes_calls_per_s"])
        assert st[prefix + "vs_pipes_il"] > 0 and prefix + "vs_pipes_il" not in pp
        assert "pipes_calls_per_s" not in pp
        assert res["ideal"][prefix + "of_ideal"] == 1.0
    assert st["info"]["default"]["mode"] == "agents"
    assert pp["info"]["default"]["mode"] == "shipped state"
    assert "lockstep" not in bench_cli.DEFAULT_WORKLOADS  # 10-20 s at --quick: run by name
