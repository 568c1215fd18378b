"""Pipeline schedules as data: every builder validates, bubbles and in-flight activations match the formulas, and the
validator catches the schedules that would hang or hand gloo's receives the wrong tensor."""

from __future__ import annotations

import pytest

from autoshard.schedules import (
    KINDS,
    Action,
    ScheduleError,
    _rendezvous,
    bubble_formula,
    dual_pipe_v,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    placement_of,
    render,
    schedule,
    simulate,
    validate,
    zero_bubble_h1,
    zero_bubble_v,
)

RANKS = [1, 2, 4]
MICROBATCHES = [1, 2, 4, 8]
# forward:backward cost ratios; the bubble formulas hold for any ratio (see test_bubble_* docstrings)
COSTS = [(1.0, 1.0), (1.0, 2.0)]


def parse(rows: dict[int, str]) -> dict[int, list[Action]]:
    return {rank: [Action.parse(text) for text in row.split()] for rank, row in rows.items()}


def builds() -> list[tuple[str, int, int, int]]:
    cases = [(name, p, m, 1) for name in ("gpipe", "1f1b", "interleaved", "zb-h1") for p in RANKS
             for m in MICROBATCHES]
    return cases + [("interleaved", p, m, v) for v in (2, 3) for p in RANKS for m in MICROBATCHES] + [
        ("zbv", p, m, 2) for p in RANKS for m in MICROBATCHES] + [
        ("dualpipev", p, m, 2) for p in RANKS for m in MICROBATCHES if m >= 2 * p]


@pytest.mark.parametrize("name,p,m,v", builds())
def test_every_builder_validates(name, p, m, v):
    actions = schedule(name, p, m, v)
    validate(actions, p, v, placement_of(name))
    assert sorted(actions) == list(range(p))
    computes = [a for steps in actions.values() for a in steps if a.is_compute]
    backwards = sum(1 for a in computes if a.kind in ("B", "I"))
    assert backwards == sum(1 for a in computes if a.kind == "F") == m * p * v
    assert len(computes) == 2 * m * p * v + sum(1 for a in computes if a.kind == "W")
    if p == 1:
        assert computes == actions[0], "one rank sends nothing"


# ---------------------------------------------------------------------------------------------------- actions


@pytest.mark.parametrize("kind", KINDS)
def test_action_prints_compactly_and_parses_back(kind):
    action = Action(kind, 12, 3)
    assert str(action) == f"3{kind}12" == repr(action)
    assert Action.parse(str(action)) == action
    assert Action.parse(" 3F1 ") == Action("F", 1, 3)


@pytest.mark.parametrize("text", ["F1", "3X1", "3F", "3F1x", "3SEND1"])
def test_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_peer_and_partner_follow_the_documented_convention():
    p = 4  # stage s on rank s % 4
    assert Action.parse("3SEND_F1").peer(p) == 0 and Action.parse("3SEND_F1").partner() == Action.parse("4RECV_F1")
    assert Action.parse("4RECV_F1").peer(p) == 3 and Action.parse("4RECV_F1").partner() == Action.parse("3SEND_F1")
    assert Action.parse("4SEND_B1").peer(p) == 3 and Action.parse("4SEND_B1").partner() == Action.parse("3RECV_B1")
    assert Action.parse("3RECV_B1").peer(p) == 0 and Action.parse("3RECV_B1").partner() == Action.parse("4SEND_B1")
    assert Action.parse("5F0").rank(p) == 1
    with pytest.raises(ValueError, match="compute action"):
        Action.parse("3F1").peer(p)


def test_actions_are_checked_when_built():
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        Action("F", -1, 0)


# ----------------------------------------------------------------------------------------------------- bubbles


@pytest.mark.parametrize("forward_cost,backward_cost", COSTS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, forward_cost, backward_cost):
    """For any forward cost f and backward cost b the step takes (m + p - 1)(f + b): the first microbatch needs p - 1
    forwards to reach the last rank and its gradient p - 1 backwards to come back, and in between the last rank (in
    GPipe and 1F1B alike) is never idle. Each rank computes m(f + b), so the idle fraction is (p-1)/(m+p-1)."""
    sim = simulate(schedule(name, p, m), p, forward_cost=forward_cost, backward_cost=backward_cost)
    assert sim.makespan == pytest.approx((m + p - 1) * (forward_cost + backward_cost))
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("forward_cost,backward_cost", COSTS)
@pytest.mark.parametrize("p,m", [(p, m) for p in RANKS for m in MICROBATCHES if m >= p])
@pytest.mark.parametrize("v", [2, 3])
def test_bubble_of_interleaved_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v, forward_cost, backward_cost):
    """A chunk costs f/v and b/v, so filling and draining take (p-1)(f+b)/v: the step takes (vm + p - 1)(f + b)/v
    and the bubble is (p-1)/(vm+p-1), for any f and b, once there are at least p microbatches."""
    sim = simulate(interleaved_1f1b(p, m, v), p, v, forward_cost=forward_cost, backward_cost=backward_cost)
    assert sim.makespan == pytest.approx((v * m + p - 1) * (forward_cost + backward_cost) / v)
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (2, 4, 8, 16) if m >= p])
def test_bubble_of_zb_h1_is_p_minus_1_over_3m_plus_p_minus_1(p, m):
    """With the backward split into I and W of one forward's cost each, ZB-H1's last rank never idles after its
    first forward and the other ranks fill 1F1B's cool-down with their deferred W: the step takes 3m + p - 1 units
    and the bubble is (p-1)/(3m+p-1), a third of 1F1B's idle time. Every rank holds p microbatches (1F1B's first
    rank's peak), as each W comes r backwards late on rank r."""
    sim = simulate(zero_bubble_h1(p, m), p, forward_cost=1.0, backward_cost=2.0)
    assert sim.makespan == pytest.approx(3 * m + p - 1)
    assert sim.bubble == pytest.approx((p - 1) / (3 * m + p - 1)) == pytest.approx(bubble_formula("zb-h1", p, m)[1])
    assert sim.peak_in_flight == dict.fromkeys(range(p), p)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (4, 8, 16) if m >= 2 * p - 1])
def test_bubble_of_zbv_is_p_minus_1_over_6m_plus_p_minus_1(p, m):
    """ZBV's chunks cost half a stage (F, I and W half a unit each): only the fill ramp of p - 1 chunk forwards
    idles, so the step takes (6m + p - 1)/2 units and the bubble is (p-1)/(6m+p-1), given 2p - 1 microbatches to
    fill the V. Every rank holds 2p chunks, p stage-equivalents."""
    sim = simulate(zero_bubble_v(p, m), p, 2, forward_cost=1.0, backward_cost=2.0, placement="v")
    assert sim.makespan == pytest.approx((6 * m + p - 1) / 2)
    assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1)) == pytest.approx(bubble_formula("zbv", p, m, 2)[1])
    assert sim.peak_in_flight == dict.fromkeys(range(p), p)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8) for m in (4, 8, 16) if m >= 2 * p])
def test_bubble_of_dualpipev_is_zbvs_at_half_a_stage_more_memory(p, m):
    """DualPipeV pairs a forward of one chunk with a backward of the other after the warm-up and splits only
    the ramps' backwards: with F, I and W of equal cost it idles as ZBV does, (p-1)/(6m+p-1), holding 2p + 1
    chunks (p + 1/2 stages) on every rank."""
    sim = simulate(dual_pipe_v(p, m), p, 2, forward_cost=1.0, backward_cost=2.0, placement="v")
    assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
    assert sim.peak_in_flight == dict.fromkeys(range(p), p + 0.5)


def test_dualpipev_is_torchs_order_and_needs_2p_microbatches():
    computes = {r: " ".join(str(a) for a in steps if a.is_compute) for r, steps in dual_pipe_v(2, 4).items()}
    assert computes[0] == "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3"
    assert computes[1] == "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"
    with pytest.raises(ValueError, match="needs at least 2p = 8 microbatches, got m=4"):
        dual_pipe_v(4, 4)


def test_the_v_places_two_chunks_per_rank_and_its_tip_sends_nothing():
    actions = zero_bubble_v(2, 4)
    assert {a.stage for a in actions[0]} == {0, 3} and {a.stage for a in actions[1]} == {1, 2}
    assert not [a for a in actions[1] if a.kind == "SEND_F" and a.stage == 1], "stage 1 hands stage 2 its input here"
    first = [str(a) for a in actions[0] if a.is_compute][:9]
    assert first == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "3I1", "3W1"]


def test_validate_catches_a_weight_gradient_before_its_input_gradient_and_a_backward_run_twice():
    actions = zero_bubble_h1(2, 2)
    swapped = {r: list(steps) for r, steps in actions.items()}
    i, w = swapped[1].index(Action.parse("1I0")), swapped[1].index(Action.parse("1W0"))
    swapped[1][i], swapped[1][w] = swapped[1][w], swapped[1][i]
    with pytest.raises(ScheduleError, match=r"1W0\): runs before 1I0"):
        validate(swapped, 2)
    twice = {r: list(steps) for r, steps in actions.items()}
    twice[1].append(Action.parse("1B1"))
    with pytest.raises(ScheduleError, match="runs backward twice on stage 1"):
        validate(twice, 2)
    missing = {r: [a for a in steps if str(a) != "0W1"] for r, steps in actions.items()}
    with pytest.raises(ScheduleError, match=r"never runs backward on stage 0 \(0W1 missing\)"):
        validate(missing, 2)


def test_interleaving_does_not_help_with_fewer_microbatches_than_ranks():
    """With m < p a round of microbatches leaves the first rank before the previous chunk comes back, so the rank
    idles between chunks: the bubble is above (p-1)/(vm+p-1) (p=4, m=2, v=2: 5/9 instead of 3/7)."""
    sim = simulate(interleaved_1f1b(4, 2, 2), 4, 2)
    assert sim.bubble == pytest.approx(5 / 9)
    assert sim.bubble > 3 / 7


def test_send_cost_occupies_the_sender_and_delays_the_receiver():
    actions = gpipe(2, 1)
    sim = simulate(actions, 2, forward_cost=1.0, backward_cost=2.0, send_cost=0.5)
    # rank 0: F [0, 1], send [1, 1.5]; rank 1: F [1.5, 2.5], B [2.5, 4.5], send [4.5, 5]; rank 0: B [5, 7]
    assert dict(zip(map(str, actions[0]), sim.times[0], strict=True)) == {
        "0F0": (0.0, 1.0), "0SEND_F0": (1.0, 1.5), "0RECV_B0": (1.5, 5.0), "0B0": (5.0, 7.0)}
    assert sim.makespan == 7.0
    assert sim.bubble == pytest.approx(1 - 6 / 14)


# ------------------------------------------------------------------------------------------ activations in flight


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_1f1b_holds_at_most_p_minus_rank_microbatches(p, m):
    sim = simulate(one_f_one_b(p, m), p)
    assert sim.peak_in_flight_chunks == {r: min(p - r, m) for r in range(p)}
    assert sim.peak_in_flight[0] == min(p, m)
    assert max(sim.peak_in_flight.values()) <= p


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_gpipe_holds_every_microbatch(p, m):
    assert simulate(gpipe(p, m), p).peak_in_flight == dict.fromkeys(range(p), m)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_first_rank_holds_p_plus_p_minus_1_over_v_stages(p, v):
    """Rank 0 warms up with (v-1)p + 2(p-1) chunk forwards and runs one more forward before its first backward:
    vp + p - 1 chunks, that is p + (p-1)/v stage-equivalents (p=4, v=2: 11 chunks, 5.5). Rank r holds 2r chunks
    fewer. With m = p every forward runs before the first backward: vm chunks, m stage-equivalents."""
    sim = simulate(interleaved_1f1b(p, 2 * p, v), p, v)
    assert sim.peak_in_flight_chunks == {r: v * p + p - 1 - 2 * r for r in range(p)}
    assert sim.peak_in_flight[0] == pytest.approx(p + (p - 1) / v)
    assert simulate(interleaved_1f1b(p, p, v), p, v).peak_in_flight[0] == p


# ------------------------------------------------------------------------------------------------- validation

GPIPE_2x2 = {
    0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    1: "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
}


def test_the_hand_written_schedule_is_what_gpipe_builds():
    assert parse(GPIPE_2x2) == gpipe(2, 2)


def test_validate_catches_receives_out_of_send_order():
    """Rank 0 runs its backwards in reverse and receives each gradient just before using it. Both gradients have
    the same shape, so gloo would hand 0RECV_B1 the gradient of microbatch 0."""
    rows = {**GPIPE_2x2, 0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B1 0RECV_B0 0B0"}
    with pytest.raises(ScheduleError) as caught:
        validate(parse(rows), 2, 1)
    error = caught.value
    assert (error.rank, error.step, str(error.action)) == (0, 4, "0RECV_B1")
    message = str(error)
    assert message.startswith("rank 0, step 4 (0RECV_B1): receive #0 from rank 1 expects 1SEND_B1, but message #0")
    assert "is 1SEND_B0 (rank 1, step 5)" in message and "send order" in message
    assert "[<B1]" in message and "<-- step 4: 0RECV_B1" in message, "the grid marks the failing step"
    # Receiving in send order, then computing in any order, is fine.
    validate(parse({**rows, 0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0RECV_B1 0B1 0B0"}), 2, 1)


def test_validate_catches_a_missing_send():
    rows = {**GPIPE_2x2, 0: "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1"}
    with pytest.raises(ScheduleError, match=r"rank 1, step 2 \(1RECV_F1\): nothing sends it: 0SEND_F1 is missing"):
        validate(parse(rows), 2, 1)


def test_validate_catches_a_deadlock():
    rows = {0: "0RECV_B0 0F0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}
    with pytest.raises(ScheduleError) as caught:
        validate(parse(rows), 2, 1)
    message = str(caught.value)
    assert message.startswith("rank 0, step 0 (0RECV_B0): deadlock")
    assert "rank 0 at step 0 (0RECV_B0) waits for 1SEND_B0; rank 1 at step 0 (1RECV_F0) waits for 0SEND_F0" in message


@pytest.mark.parametrize("rows,error", [
    ({0: "0F0 0SEND_F0 0B0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}, r"rank 0, step 2 \(0B0\): needs 0RECV_B0, which is "),
    ({0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1F0 1RECV_F0 1B0 1SEND_B0"}, r"rank 1, step 0 \(1F0\): runs before 1RECV_F0"),
    ({0: "0F0 0SEND_F0 0RECV_B0 0B0", 1: "1RECV_F0 1F0 1SEND_B0"}, r"rank 1, step 1 \(1F0\): .* never runs backward"),
    ({0: "0F0 0SEND_F0 0RECV_B0 0B0 0F0", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}, r"rank 0, step 4 \(0F0\): duplicate"),
    ({0: "0F0 0SEND_F0 0RECV_B0 0B0 1F1", 1: "1RECV_F0 1F0 1B0 1SEND_B0"}, r"stage 1 lives on rank 1"),
])
def test_validate_names_rank_step_and_action(rows, error):
    with pytest.raises(ScheduleError, match=error):
        validate(parse(rows), 2, 1)


def test_validate_wants_every_rank():
    with pytest.raises(ScheduleError, match=r"has ranks \[0\]; expected exactly the ranks 0..1"):
        validate({0: [Action("F", 0, 0), Action("B", 0, 0)]}, 2, 1)


# ------------------------------------------------------------------------------------------------ builders' input


def test_schedule_names_the_valid_schedules():
    with pytest.raises(ValueError, match="valid names are 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zbv', "
                                         "'dualpipev'"):
        schedule("zero-bubble", 2, 4)
    with pytest.raises(ValueError, match="'zbv' schedule runs 2 chunks per rank in a V, got v=1"):
        schedule("zbv", 2, 4)
    with pytest.raises(ValueError, match="one chunk per rank, got v=2"):
        schedule("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="m must be a positive integer, got 0"):
        schedule("gpipe", 2, 0)


def test_interleaved_says_which_microbatch_counts_work():
    with pytest.raises(ValueError, match=r"p=4 runs m=9 .* 2 rounds .* use m=8 or m=10"):
        interleaved_1f1b(4, 9, 2)
    validate(interleaved_1f1b(4, 10, 2), 4, 2)  # 2 rounds of 5, as torch allows
    validate(interleaved_1f1b(4, 6, 2), 4, 2)  # one round of 6


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved_1f1b(4, 8, 1) == one_f_one_b(4, 8)


# ---------------------------------------------------------------------------------------------------- drawing


def test_render_1f1b_on_2_ranks_with_4_microbatches():
    actions = one_f_one_b(2, 4)
    unit = simulate(actions, 2, forward_cost=1.0, backward_cost=1.0)
    assert render(actions, 2, sim=unit) == (
        "rank 0: F0 F1 .  B0 F2 B1 F3 B2 .  B3\n"
        "rank 1: .  F0 B0 F1 B1 F2 B2 F3 B3 ."
    )
    # A backward twice as long as a forward spans two slots.
    assert render(actions, 2, sim=simulate(actions, 2)) == (
        "rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3\n"
        "rank 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  ."
    )
    assert render(actions, 2) == "rank 0: F0 F1 B0 F2 B1 F3 B2 B3\nrank 1: F0 B0 F1 B1 F2 B2 F3 B3"


def test_render_shows_the_stage_with_chunks_and_the_comms_on_request():
    actions = interleaved_1f1b(2, 2, 2)
    first = render(actions, 2).splitlines()[0].split()
    assert first[:4] == ["rank", "0:", "F0.0", "F1.0"]
    with_comms = render(actions, 2, comms=True, mark=(0, 1))
    assert with_comms.splitlines()[0].split()[2:5] == ["F0.0", "[>F0.0]", "F1.0"]
    assert with_comms.splitlines()[0].endswith("<-- step 1: 0SEND_F0")


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2), ("zbv", 2, 4, 2),
                                        ("dualpipev", 4, 8, 2)])
def test_under_nccl_each_direction_needs_its_own_group(name, p, m, v):
    """Where a send waits for its receive (NCCL), one group for both directions deadlocks every schedule with a
    steady state (rank 0 sends an activation while rank 1 sends it a gradient, each before its receive); with a
    group per direction, as the executor sends, every one runs (``validate`` checks it for every builder)."""
    actions = schedule(name, p, m, v)
    _rendezvous(actions, p, placement_of(name))
    with pytest.raises(ScheduleError, match=r"deadlock where a send waits for its receive \(NCCL\): rank 0's "
                                            r"stream to rank 1 starts with 0SEND_F"):
        _rendezvous(actions, p, placement_of(name), both_ways=True)


def test_every_schedule_has_one_record_that_builds_it_as_it_says():
    """``SPECS`` is the one record of each schedule: its chunks, placement and bubble formula are what the schedule
    it builds runs (the placement validated, the formula equal to the simulated idle share)."""
    from autoshard import schedules
    from autoshard.kinds import ScheduleName

    assert set(schedules.SPECS) == set(ScheduleName)
    for name, found in schedules.SPECS.items():
        v = found.chunks or 2
        p, m = 2, 4 * v
        actions = schedules.schedule(name, p, m, v)
        schedules.validate(actions, p, v, found.placement)
        assert schedules.placement_of(name) == found.placement
        if found.splits_backward:
            assert any(a.kind == "W" for steps in actions.values() for a in steps), name
        sim = schedules.simulate(actions, p, v, forward_cost=1.0, backward_cost=2.0, placement=found.placement)
        if name != ScheduleName.DUALPIPEV:  # its F and B pairs overlap: the simulation's share is below the formula
            assert sim.bubble == pytest.approx(found.fraction(p, m, v)), (name, sim.bubble)
    assert schedules.named(1) == "1f1b" and schedules.named(2) == "interleaved"
    assert schedules.named(1, zero_bubble=True) == "zb-h1" and schedules.named(2, zero_bubble=True) == "zbv"
