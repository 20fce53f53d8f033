"""The chaos benchmark's arithmetic: a fault's cost read off the timeline of delivered rounds."""

from __future__ import annotations

import pytest

from paraloom.bench.chaos import _fault_costs, pair_ratios

pytestmark = pytest.mark.timeout(30)


def test_a_faults_cost_is_the_gap_less_the_rounds_it_delivered():
    # Rounds every 0.1 s, then a 1.0 s gap around a fault at t=2.05 that delivered 3 rounds.
    timeline = [(1.0 + 0.1 * i, i) for i in range(11)] + [(3.0, 13), (3.1, 14)]
    chaos = {"timeline": timeline, "started": 1.0}
    costs = _fault_costs(chaos, [(2.05, "kill", 1), (5.0, "stop", 0)], round_s=0.1)
    assert len(costs) == 1  # the second fault came after the last round: no cost to read
    assert costs[0]["kind"] == "kill" and costs[0]["at"] == pytest.approx(1.05)
    assert costs[0]["lost_s"] == pytest.approx((3.0 - 2.0) - 3 * 0.1)


def test_the_first_reply_after_a_fault_counts_with_every_round_it_delivered():
    # Messages of 4 rounds (0.1 s each) answered at once; a fault at t=1.45 costs 0.3 s: the
    # reply that should have come at 1.8 comes at 2.1, with its 4 rounds (1 ms apart).
    timeline = [(1.4 + 0.001 * i, 4 + i) for i in range(4)]
    timeline += [(2.1 + 0.001 * i, 8 + i) for i in range(4)]
    chaos = {"timeline": timeline, "started": 0.0}
    costs = _fault_costs(chaos, [(1.45, "exit", 0)], round_s=0.1)
    assert costs[0]["lost_s"] == pytest.approx((2.103 - 1.403) - 4 * 0.1)


def test_each_pairs_throughput_kept_is_its_clean_seconds_over_its_chaos_seconds():
    pairs = pair_ratios([20.0, 18.0, 15.0], [25.0, 18.0, 14.0])
    assert pairs == {"min": pytest.approx(0.8), "median": pytest.approx(1.0),
                     "max": pytest.approx(15 / 14)}
    with pytest.raises(ValueError, match="2 clean fits and 1 chaos fits"):
        pair_ratios([1.0, 2.0], [1.0])


def test_alternating_fits_join_into_one_timeline_and_faults_land_on_it(tmp_path):
    # Two chaos fits of 10 s at clock 100 and 150 (a clean one ran between): joined, the
    # second follows the first at 10 s, its rounds counted on; a fault at clock 155 lands at
    # 15 s, and one outside every fit (none should be) is left out.
    from paraloom.bench.chaos import _fired, _joined, _round_s

    def fit(start: float) -> dict:
        return {"started": start, "seconds": 10.0, "accuracy": 0.9, "orphans": [],
                "timeline": [(start + 1.0 + i, i) for i in range(9)],
                "recoveries": [{"rank": 0, "detected_at": 4.0}]}

    joined = _joined([fit(100.0), fit(150.0)])
    assert joined["seconds"] == 20.0 and joined["segments"] == [10.0, 10.0]
    assert joined["timeline"][9] == (11.0, 9)  # the second fit's first round
    assert [r["detected_at"] for r in joined["recoveries"]] == [4.0, 14.0]
    (tmp_path / "fired.log").write_text("155.0 kill 1\n130.0 exit 0\n")
    assert _fired(tmp_path, joined["spans"]) == [(15.0, "kill", 1)]
    assert _round_s([fit(100.0), fit(150.0)]) == pytest.approx(1.0)


def test_the_faults_keep_their_pace_across_the_chaos_fits():
    # Faults every 10 s: after fits of 19 s in all, the next is due 1 s into the next fit;
    # after exactly 20 s, a whole period in.
    from paraloom.bench.chaos import next_fault_s

    assert next_fault_s(0.0, 10.0) == pytest.approx(10.0)
    assert next_fault_s(19.0, 10.0) == pytest.approx(1.0)
    assert next_fault_s(20.0, 10.0) == pytest.approx(10.0)
    assert next_fault_s(23.5, 10.0) == pytest.approx(6.5)


@pytest.mark.parametrize("bench", ["faults", "training", "serving", "inference", "data"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys,
                                                                        bench):
    # The check is at parse time: a chaos run of minutes used to end in IsADirectoryError.
    from paraloom.cli import main

    flag = "--output" if bench == "serving" else "--out"
    with pytest.raises(SystemExit) as stopped:
        main(["bench", bench, flag, str(tmp_path)])
    assert stopped.value.code == 2
    assert f"{str(tmp_path)!r} is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        main(["bench", bench, flag, str(tmp_path / "file" / "results.json")])
    assert "which is a file" in capsys.readouterr().err
