"""budget_memory.py: the machine's pass costs, measured once, and the budget memory that outlives a process where
asked."""
import json

import cpu_forward
import draft_config as dc
from budget_memory import pass_costs
from engine import Engine, build_engine
from sampling import Sampling
from test_generate import (PROMPTS, autoregressive, make_drafter, recorded_budgets, target,
                           tiny)  # noqa: F401 (tiny: a fixture)


def test_pass_costs_are_measured_once_per_machine(tiny, monkeypatch, tmp_path):
    """The budget's pass-cost table: every size of the budget range, timed on the first request with the
    budget and read from the cache afterwards (a second engine too), and the request is still lossless."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    calls, real = [], cpu_forward.pass_seconds
    monkeypatch.setattr(cpu_forward, "pass_seconds", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    m = target(tiny[0])
    budgets = recorded_budgets(monkeypatch)
    for _ in range(2):
        eng = Engine(m, drafter=make_drafter("eagle3", tiny, m, "nanospec"), budget=True)
        assert eng.generate(PROMPTS[0], 12)[0] == autoregressive(m, PROMPTS[0], 12)
    assert calls == [[1, 2, 4, 8, 10]]
    costs = pass_costs(m, 10)
    assert sorted(costs) == [1, 2, 4, 8, 10] and all(v > 0 for v in costs.values()) and len(calls) == 1
    assert budgets[-1].of["eagle"].pass_s == costs
    # timings taken while the process waited for its CPUs serve that request and are measured again next time
    import cbuild
    waited = iter(range(0, 10 ** 6, 1000))  # 1000 s waited during every measurement
    monkeypatch.setattr(cbuild, "run_delay", lambda: float(next(waited)))
    busy = pass_costs(m, 10, extra=(3,))
    assert sorted(busy) == [1, 2, 3, 4, 8, 10] and calls[1:] == [[3]]
    assert sorted(pass_costs(m, 10, extra=(3,))) == [1, 2, 3, 4, 8, 10] and calls[1:] == [[3], [3]]


def test_budget_memory_outlives_the_process_where_asked(tiny, tmp_path, monkeypatch):
    """build_engine(budget_cache=True) (the CLI): a request's budget memory and the hybrid head's start price
    are stored under a key of the machine, model and settings; a new engine of the same settings (the next
    `python generate.py`) starts from them, one of other settings (sampling) from nothing, and an unreadable
    file leaves the memory empty. Outputs stay autoregressive decoding's."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("NANOSPEC_BUDGET_CACHE", "on")
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    c = dc.DraftConfig(str(tiny[1]["eagle3"]), "nanospec", 4, 3, 10, spec_k=4, w_max=64, ngram=None)
    new = lambda sampling=Sampling(): build_engine(m, None, c, sampling, budget_cache=True)
    first = new()
    assert first.memory.sources == {}
    out, _ = first.generate(prompt, 40)
    assert out == ref and first.memory.sources
    stored = json.loads((tmp_path / "budget.json").read_text())
    assert len(stored) == 1 and set(next(iter(stored.values()))["sources"]) == set(first.memory.sources)
    second = new()
    assert ({k: b.state() for k, b in second.memory.sources.items()}
            == {k: b.state() for k, b in first.memory.sources.items()})
    assert second.drafter.start_rate == first.drafter.start_rate
    out, _ = second.generate(prompt, 40)
    assert out == ref
    assert new(Sampling(temperature=0.7)).memory.sources == {}  # another key
    assert build_engine(m, None, c, Sampling()).memory.sources == {}  # no budget_cache: benchmarks start afresh
    (tmp_path / "budget.json").write_text("{not json")
    assert new().memory.sources == {}
    monkeypatch.setenv("NANOSPEC_BUDGET_CACHE", "off")
    (tmp_path / "budget.json").unlink()
    new().generate(prompt, 8)
    assert not (tmp_path / "budget.json").exists()
