"""validate.seeds=auto: the alpha-spending rule, checked against closed forms, and calibrated on synthetic curves.

The calibration draws many synthetic validations (numpy, seeded): per seed, a bf16 loss curve with its own
offset and a candidate curve = that curve x (1 + true gap + a per-seed drift), plus evaluation noise; the paired
gap of a seed is computed here from the documented rule (window means of the last W evaluations); the looks
then use the design's critical values. False PASS is counted at a true gap equal to the margin, power at gap 0,
for the fixed design (t(0.95, n - 1) at n seeds) and for the sequential one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fp8train.evidence import sequential, stats

MARGIN, WINDOW = 0.02, 3
STEPS = np.arange(0, 201, 25, dtype=float)
MAIN_JOB_PAIRED_SD = 0.003  # twice the paired spread measured on the main job (tests/test_validate.py)
DRAWS = 50_000
SE_5PCT = math.sqrt(0.05 * 0.95 / DRAWS)


# ------------------------------------------------------------------------------------------------------------
# The spending functions and critical values, against closed forms
# ------------------------------------------------------------------------------------------------------------
def test_spending_functions_by_their_formulas():
    # Lan & DeMets (1983): pocock alpha ln(1 + (e - 1) t); O'Brien-Fleming type 2 - 2 Phi(z / sqrt(t)) =
    # erfc(z / sqrt(2 t)) with z = Phi^-1(1 - alpha / 2) = 1.959963984540054 for alpha = 0.05.
    z = 1.959963984540054
    for t in (0.25, 0.5, 0.75, 1.0):
        assert sequential.spend("pocock", t, 0.05) == pytest.approx(0.05 * math.log(1 + (math.e - 1) * t), rel=1e-12)
        assert sequential.spend("obrien_fleming", t, 0.05) == pytest.approx(math.erfc(z / math.sqrt(2 * t)),
                                                                            rel=1e-9)
    assert sequential.spend("pocock", 1.0, 0.05) == pytest.approx(0.05, rel=1e-12)
    assert sequential.spend("obrien_fleming", 1.0, 0.05) == pytest.approx(0.05, rel=1e-9)
    with pytest.raises(ValueError, match="validate.spending"):
        sequential.spend("haybittle", 0.5, 0.05)


@pytest.mark.parametrize("rule", ["pocock", "obrien_fleming"])
@pytest.mark.parametrize("max_seeds", [2, 3, 6, 10])
def test_design_spends_exactly_alpha_and_its_first_critical_value_is_a_cauchy_quantile(rule, max_seeds):
    design = sequential.make_design(max_seeds, rule)
    assert design.looks == tuple(range(2, max_seeds + 1))
    assert sum(design.spent) == pytest.approx(0.05, rel=1e-9) and all(a > 0 for a in design.spent)
    # the first look has 2 seeds: a t with 1 df is Cauchy, quantile tan(pi (p - 1/2))
    assert design.critical[0] == pytest.approx(math.tan(math.pi * (0.5 - design.spent[0])), rel=1e-9)
    # every look is wider than the fixed design's bound at the same seeds
    assert all(c > stats.t_quantile(0.95, n - 1) for c, n in zip(design.critical, design.looks)) or max_seeds == 2


def test_sequential_verdict_looks_in_order_and_stops_at_the_first_decision():
    design = sequential.make_design(4)
    # two seeds 1e-4 apart around 0.5%: se 5e-5, c_1 ~ 10 -> upper ~ 1% <= 2%: PASS at the first look
    out = sequential.sequential_verdict([0.00495, 0.00505, 0.9], design, MARGIN)
    assert (out.verdict, out.estimate.n, out.look) == ("pass", 2, 1)
    assert out.upper == pytest.approx(0.005 + design.critical[0] * 0.00005, rel=1e-9)
    wide = [0.0, 0.02]  # se 0.01: undecided at 2 seeds, asks for a third
    out = sequential.sequential_verdict(wide, design, MARGIN)
    assert (out.verdict, out.next_seeds) == ("continue", 3)
    out = sequential.sequential_verdict(wide + [0.01, 0.01], design, MARGIN)  # the last look: inconclusive
    assert (out.verdict, out.look, out.next_seeds) == ("inconclusive", 3, None)
    assert sequential.sequential_verdict([0.0], design, MARGIN, ["seed 1 diverged"]).verdict == "fail"
    assert sequential.sequential_verdict([0.2, 0.2001], design, MARGIN).verdict == "fail"


@pytest.mark.parametrize("gaps", [[], [0.004]])
def test_before_the_first_look_the_verdict_asks_for_its_seeds(gaps):
    """Fewer usable seeds than the first look (2): no bound yet, and the next look is the first one."""
    out = sequential.sequential_verdict(gaps, sequential.make_design(5), MARGIN)
    assert (out.verdict, out.reason, out.next_seeds, out.look) == ("continue", "needs 2 seeds for its first look",
                                                                   2, 0)
    assert (out.lower, out.upper, out.estimate.n) == (-math.inf, math.inf, len(gaps))


@pytest.mark.parametrize("override, names", [
    ("validate.max_seeds=1", "validate.max_seeds"), ("validate.spending=haybittle", "validate.spending"),
    ("validate.seeds=sometimes", "validate.seeds"),
])
def test_bad_auto_settings_are_refused_by_name(override, names):
    from fp8train.training.config import load_config

    with pytest.raises(ValueError, match=names):
        load_config(None, ["validate.seeds=auto", override])


def test_auto_plans_max_seeds_seeds_from_train_seed_so_repetitions_can_be_disjoint():
    """An independent repetition of a seeds=auto validation is the same command with train.seed moved on by
    max_seeds (docs/validation-fork.md): its planned seeds are train.seed, +1, ..., and the rounds take them in
    that order, so two such repetitions share no seed."""
    from fp8train.evidence.run_plan import plan_runs
    from fp8train.training.config import load_config

    def planned(first_seed: int) -> list[int]:
        cfg = load_config(None, ["validate.seeds=auto", "validate.max_seeds=4", f"train.seed={first_seed}",
                                 "validate.candidates=[current]", "run.dir=/nonexistent"])
        return list(dict.fromkeys(r.seed for r in plan_runs(cfg)))

    assert planned(1337) == [1337, 1338, 1339, 1340]
    assert planned(1341) == [1341, 1342, 1343, 1344]


# ------------------------------------------------------------------------------------------------------------
# Calibration on synthetic curves
# ------------------------------------------------------------------------------------------------------------
def _synthetic_gaps(rng, true_gap: float, paired_sd: float, seeds: int, draws: int) -> np.ndarray:
    """(draws, seeds) paired gaps of synthetic curves: the relative gap of the window means."""
    base = (2.0 + 3.5 * np.exp(-STEPS / 60) + rng.normal(0, 0.05, (draws, seeds, 1))
            + rng.normal(0, 1e-4, (draws, seeds, STEPS.size)))
    drift = rng.normal(0, paired_sd, (draws, seeds, 1))
    cand = base * (1 + true_gap + drift) + rng.normal(0, 1e-4, (draws, seeds, STEPS.size))
    base_mean, cand_mean = base[..., -WINDOW:].mean(-1), cand[..., -WINDOW:].mean(-1)
    return (cand_mean - base_mean) / base_mean


def _looks(gaps: np.ndarray, looks, critical) -> tuple[np.ndarray, np.ndarray]:
    """(verdict 0 undecided / 1 pass / 2 fail, seeds used) of each draw: the first look that decides."""
    verdict = np.zeros(len(gaps), dtype=np.int8)
    used = np.full(len(gaps), looks[-1])
    for n, c in zip(looks, critical):
        x = gaps[:, :n]
        mean, se = x.mean(1), x.std(1, ddof=1) / math.sqrt(n)
        open_ = verdict == 0
        passed, failed = open_ & (mean + c * se <= MARGIN), open_ & (mean - c * se > MARGIN)
        verdict[passed], verdict[failed] = 1, 2
        used[passed | failed] = n
    return verdict, used


def _fixed(n: int):
    return (n,), (stats.t_quantile(0.95, n - 1),)


def _sequential(max_seeds: int, rule: str):
    design = sequential.make_design(max_seeds, rule)
    return design.looks, design.critical


@pytest.fixture(scope="module")
def at_the_margin():
    return _synthetic_gaps(np.random.default_rng(2032), MARGIN, MAIN_JOB_PAIRED_SD, 10, DRAWS)


@pytest.mark.parametrize("rule", ["pocock", "obrien_fleming"])
@pytest.mark.parametrize("max_seeds", [3, 4, 6, 10])
def test_sequential_false_pass_at_the_margin_is_at_most_5_percent(at_the_margin, rule, max_seeds):
    verdict, _ = _looks(at_the_margin, *_sequential(max_seeds, rule))
    false_pass, false_fail = (verdict == 1).mean(), (verdict == 2).mean()
    print(f"{rule} max_seeds={max_seeds}: false PASS {false_pass:.2%}, false FAIL {false_fail:.2%} at the margin")
    assert false_pass <= 0.05 and false_fail <= 0.05


@pytest.mark.parametrize("n", [3, 6])
def test_fixed_design_false_pass_is_5_percent_and_naive_repeated_looks_exceed_it(at_the_margin, n):
    """The simulation can see 5%: the fixed t test sits on it, and looking at 2..n seeds with the fixed bound at
    every look (no spending) is well above it."""
    verdict, _ = _looks(at_the_margin, *_fixed(n))
    assert abs((verdict == 1).mean() - 0.05) <= 3 * SE_5PCT
    looks = tuple(range(2, n + 1))
    naive, _ = _looks(at_the_margin, looks, tuple(stats.t_quantile(0.95, k - 1) for k in looks))
    assert (naive == 1).mean() > 0.05 + 10 * SE_5PCT


def test_power_at_gap_zero_and_expected_seeds():
    """At gap 0: P(PASS) and the mean seeds per candidate, fixed vs sequential (printed: pytest -s). At the
    main job's noise the sequential design passes as surely as fixed 3 seeds with fewer seeds; at noise half the
    margin it passes more often than fixed 3 seeds (it may add seeds), using fewer than its 6."""
    rng = np.random.default_rng(7)
    rows = {}
    for sd in (MAIN_JOB_PAIRED_SD, MARGIN / 2):
        gaps = _synthetic_gaps(rng, 0.0, sd, 10, 20_000)
        for name, design in (("fixed 3", _fixed(3)), ("fixed 6", _fixed(6)),
                             ("pocock max 6", _sequential(6, "pocock")),
                             ("obrien_fleming max 6", _sequential(6, "obrien_fleming"))):
            verdict, used = _looks(gaps, *design)
            rows[sd, name] = ((verdict == 1).mean(), used.mean())
            print(f"paired sd {sd:.2%}: {name}: power {rows[sd, name][0]:.3f}, mean seeds {rows[sd, name][1]:.2f}")
    main = rows[MAIN_JOB_PAIRED_SD, "pocock max 6"]
    assert main[0] >= 0.99 and main[1] < 3 and rows[MAIN_JOB_PAIRED_SD, "fixed 3"][0] >= 0.99
    noisy = rows[MARGIN / 2, "pocock max 6"]
    assert noisy[0] > rows[MARGIN / 2, "fixed 3"][0] and noisy[1] < 6


def test_main_job_decides_with_fewer_runs_than_three_fixed_seeds():
    """Four harmless candidates at the main job's noise: the baseline runs while any is undecided, each
    candidate until its own decision. Expected runs against the fixed design's 3 x (1 + 4) = 15."""
    rng = np.random.default_rng(8)
    looks, critical = _sequential(6, "pocock")
    for sd in (MAIN_JOB_PAIRED_SD / 2, MAIN_JOB_PAIRED_SD):  # as measured, and twice that
        used = np.stack([_looks(_synthetic_gaps(rng, 0.0, sd, 6, 10_000), looks, critical)[1]
                         for _ in range(4)], axis=1)  # (draws, candidates)
        runs = used.max(1) + used.sum(1)
        print(f"paired sd {sd:.2%}: expected runs {runs.mean():.2f} (fixed 3 seeds: 15); P(10 runs) "
              f"{(runs == 10).mean():.3f}")
        assert runs.mean() < 15


def test_sequential_verdict_agrees_with_the_vectorized_looks(at_the_margin):
    """The shipped function, draw by draw, against the rule written out above (2000 draws)."""
    design = sequential.make_design(6)
    verdict, used = _looks(at_the_margin[:2000, :6], design.looks, design.critical)
    names = {0: "inconclusive", 1: "pass", 2: "fail"}
    for row, v, n in zip(at_the_margin[:2000, :6], verdict, used):
        out = sequential.sequential_verdict(list(row), design, MARGIN)
        assert (out.verdict, out.estimate.n) == (names[int(v)], int(n))


# ------------------------------------------------------------------------------------------------------------
# Through a real validation
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_auto_validation_stops_when_decided_and_refuses_another_cap(tmp_path, tiny, capsys):
    """validate.seeds=auto on the tiny model: plan.json declares the looks; `current` at a 5% margin is decided
    at the first look (2 seeds: 4 runs of the 6 that 3 seeds would make); the report says what it cost; a re-run
    reuses everything; another max_seeds is refused before anything runs."""
    import json
    import shutil

    from fp8train.evidence.validate import run_validation
    from fp8train.training.config import load_config
    from tests.test_verdict_threshold import TINY_VALIDATION

    overrides = [f"run.dir={tmp_path}", "run.name=auto", f"data.path={tiny.corpus}", *TINY_VALIDATION,
                 "validate.seeds=auto", "validate.max_seeds=3"]
    summary = run_validation(load_config(None, overrides), candidates=["current"], show_progress=False)
    vdir = tmp_path / "auto"
    plan = json.loads((vdir / "plan.json").read_text())
    assert plan["sequential"]["looks"] == [2, 3] and plan["seeds"] == [1337, 1338, 1339]
    cand = summary["candidates"]["current"]
    assert (cand["verdict"], cand["seeds"], cand["sequential"]["look"]) == ("pass", 2, 1)
    assert cand["gap_upper"] == pytest.approx(cand["gap_mean"] + plan["sequential"]["critical"][0]
                                              * cand["gap_sd"] / math.sqrt(2), rel=1e-9)
    assert summary["seeds"] == [1337, 1338] and cand["status"]["1339"] == "not needed"
    assert not (vdir / "runs" / "bf16" / "seed1339").exists()
    cost = summary["cost"]
    assert cost["runs"] == 4 and cost["planned_seeds_runs"] == 6 and cost["cpu_seconds"] > 0
    assert "Cost: **4 runs**" in (vdir / "report.md").read_text()
    again = run_validation(load_config(None, overrides), candidates=["current"], show_progress=False)
    assert again["candidates"]["current"]["gaps"] == cand["gaps"]
    # killed before a candidate's run of the first look started, its baseline done: the re-run makes just that run
    shutil.rmtree(vdir / "runs" / "current" / "seed1338")
    again = run_validation(load_config(None, overrides), candidates=["current"], show_progress=False)
    assert again["candidates"]["current"]["gaps"] == cand["gaps"] and again["cost"]["runs"] == 4
    with pytest.raises(ValueError, match="sequential"):
        run_validation(load_config(None, overrides + ["validate.max_seeds=4"]), candidates=["current"],
                       show_progress=False)
