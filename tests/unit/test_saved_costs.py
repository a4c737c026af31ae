"""A shape tuner's costs and acceptance kept across restarts (step/tuner/saved_costs.py): on a
tuner driven by simulated steps (test_shape_tuner's `World`), a restarted tuner holds the same
costs and predictions, skips the exploration its predecessor did, and a file for another key,
a damaged file or the switch turned off are each ignored."""

import json
import sys
from pathlib import Path

import pytest

from vllm_subspec.step.tuner.saved_costs import ENV, SAVE_EVERY, SavedCosts, tuner_state
from vllm_subspec.step.tuner.tuner import ShapeTuner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_shape_tuner import STREAMING, World  # noqa: E402

KEY = {"model": "m", "machine": "this one"}


def fresh() -> ShapeTuner:
    return ShapeTuner((1, 2, 4, 6), 32, auto_width=True, auto_depth=True)


def trained(steps: int = 120, batch_size: int = 4) -> tuple[ShapeTuner, World]:
    world = World(**STREAMING, seed=4)
    tuner = fresh()
    world.time_draft_pass(tuner)
    for _ in range(steps):
        world.step(tuner, batch_size)
    return tuner, world


def test_a_restarted_tuner_holds_the_same_costs_and_predictions(tmp_path):
    tuner, _ = trained()
    SavedCosts(tmp_path, KEY).save(tuner)
    restarted = fresh()
    assert restarted.keep_costs(SavedCosts(tmp_path, KEY))
    assert tuner_state(restarted) == tuner_state(tuner)
    for w in (1, 2, 4, 6):
        reach = tuner.acceptance[w].reach().tolist()
        assert restarted.model.predicted_rates(w, range(1, 33), 4, reach) == \
            tuner.model.predicted_rates(w, range(1, 33), 4, reach)
        assert restarted.model.verify_cost(w, 500) == tuner.model.verify_cost(w, 500)
    assert restarted.model.forward(8) == tuner.model.forward(8)


def test_a_restarted_tuner_skips_the_exploration_its_predecessor_did(tmp_path):
    """A fresh tuner explores every width at full depth first; one restarted from saved costs
    goes to a chosen shape once plain's rate is measured (measured rates start afresh)."""
    tuner, world = trained()
    saved = SavedCosts(tmp_path, KEY)
    saved.save(tuner)
    restarted = fresh()
    restarted.keep_costs(saved)
    plans = [restarted.plan_step(4) for _ in range(1)]
    for _ in range(6):
        world.step(restarted, 4)
    cold = fresh()
    world.time_draft_pass(cold)
    for _ in range(6):
        world.step(cold, 4)
    assert plans[0].shape.depth == 0  # plain first: the measured rate is not remembered
    assert restarted.policy.exploring is False and cold.acceptance[1].steps < \
        restarted.acceptance[1].steps
    # the cold tuner spent its first drafting steps exploring each width; the restarted one
    # explored none (its widths' trees were counted before the restart)
    assert sum(a.steps for a in restarted.acceptance.values()) > \
        sum(a.steps for a in tuner.acceptance.values())


def test_saves_come_every_save_every_planned_steps(tmp_path):
    tuner = fresh()
    saved = SavedCosts(tmp_path, KEY)
    tuner.keep_costs(saved)
    for _ in range(SAVE_EVERY - 1):
        tuner.plan_step(1)
    assert not saved.path.exists()
    tuner.plan_step(1)
    assert json.loads(saved.path.read_text())["key"] == saved.key


def test_another_key_a_damaged_file_and_the_switch_off_are_ignored(tmp_path, monkeypatch,
                                                                   vllm_caplog):
    tuner, _ = trained(40)
    SavedCosts(tmp_path, KEY).save(tuner)
    other = SavedCosts(tmp_path, {**KEY, "machine": "another"})
    assert other.path != SavedCosts(tmp_path, KEY).path and not fresh().keep_costs(other)
    damaged = SavedCosts(tmp_path, KEY)
    damaged.path.write_text('{"key": ')
    assert not fresh().keep_costs(damaged)
    assert "ignoring the tuner's saved costs" in vllm_caplog.text
    monkeypatch.setenv(ENV, "0")
    assert not SavedCosts.enabled()
    monkeypatch.setenv(ENV, "1")
    assert SavedCosts.enabled()


def test_a_state_whose_shapes_differ_is_refused(tmp_path):
    tuner, _ = trained(40)
    saved = SavedCosts(tmp_path, KEY)
    saved.save(tuner)
    narrow = ShapeTuner((1, 2), 32, auto_width=True, auto_depth=True)  # key holds the widths
    with pytest.raises(KeyError):  # in the engine the key differs first (`saved_tuner_costs`)
        from vllm_subspec.step.tuner.saved_costs import restore

        restore(narrow, json.loads(saved.path.read_text())["state"])
