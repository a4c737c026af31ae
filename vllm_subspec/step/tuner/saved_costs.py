"""What a shape tuner learned, kept across restarts: the fitted costs (draft passes, verifies, the
rest of a step, plain steps' forward, the draft pass timed at start) and the acceptance
statistics, in one JSON file per engine config and machine (`SavedCosts`; the file's name and
its `key` say which). A restarted engine starts from them instead of exploring again; its
measured rates (`RateGuard`) start afresh, so never-slower is measured, not remembered.

Design: docs/shape_tuner.md, "Kept across restarts".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm_subspec.step.tuner.tuner import ShapeTuner

logger = logging.getLogger("vllm." + __name__)  # under vLLM's logger: its handlers, level

FORMAT = 1
SAVE_EVERY = 64  # planned steps between saves (a few kB of JSON, ~1 ms of host time)
# "0": neither load nor save (tests and benchmarks that measure a cold start)
ENV = "VLLM_SUBSPEC_TUNER_MEMORY"


def tuner_state(tuner: ShapeTuner) -> dict[str, Any]:
    """The tuner's learned costs and acceptance as plain JSON types."""
    model = tuner.model
    return {
        "draft_prior": model.draft_prior.state(),
        "draft_pass": {str(w): c.state() for w, c in model.draft_pass.items()},
        "verify": {str(w): c.state() for w, c in model.verify.items()},
        "other": model.other.state(),
        "verify_rows": {str(w): r for w, r in model.verify_rows.items()},
        "forward": model.forward.state(),
        "acceptance": {
            str(w): {"hits": a.hits.tolist(), "trials": a.trials.tolist(), "steps": a.steps}
            for w, a in tuner.acceptance.items()
        },
        "calibration": {
            "hits": tuner.calibration.hits.tolist(),
            "belief": tuner.calibration.belief.tolist(),
        },
    }


def restore(tuner: ShapeTuner, state: dict[str, Any]) -> None:
    """Put `tuner_state`'s values back (the tuner's widths and depth must be the saved ones:
    `SavedCosts`' key holds them)."""
    model = tuner.model
    model.draft_prior.load_state(state["draft_prior"])
    for w, values in state["draft_pass"].items():
        model.draft_pass[int(w)].load_state(values)
    for w, values in state["verify"].items():
        model.verify[int(w)].load_state(values)
    model.other.load_state(state["other"])
    model.verify_rows.update({int(w): float(r) for w, r in state["verify_rows"].items()})
    model.forward.load_state(state["forward"])
    for w, a in state["acceptance"].items():
        acceptance = tuner.acceptance[int(w)]
        acceptance.hits = torch.tensor(a["hits"], dtype=torch.float64)
        acceptance.trials = torch.tensor(a["trials"], dtype=torch.float64)
        acceptance.steps = int(a["steps"])
    calibration = state["calibration"]
    tuner.calibration.hits = torch.tensor(calibration["hits"], dtype=torch.float64)
    tuner.calibration.belief = torch.tensor(calibration["belief"], dtype=torch.float64)


class SavedCosts:
    """One engine config's file of `tuner_state`, under `folder`; `key`: what it is for (the
    engine config, the machine, the versions), hashed into its name and checked on load."""

    def __init__(self, folder: Path, key: dict[str, Any]):
        self.key = {"format": FORMAT, **key}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()
        self.path = Path(folder) / f"tuner-{digest[:16]}.json"

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(ENV, "1") != "0"

    def load_into(self, tuner: ShapeTuner) -> bool:
        """Restore the saved state, if there is one for this key; a bad file is logged and
        left to be overwritten."""
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            logger.warning("vllm-subspec: ignoring the tuner's saved costs %s: %s", self.path, e)
            return False
        if saved.get("key") != self.key:
            return False
        try:
            restore(tuner, saved["state"])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            logger.warning("vllm-subspec: ignoring the tuner's saved costs %s: %s", self.path, e)
            return False
        logger.info("vllm-subspec: the shape tuner starts from its saved costs (%s)", self.path)
        return True

    def save(self, tuner: ShapeTuner) -> None:
        """Write the tuner's state (atomically: a reader never sees half a file)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"key": self.key, "state": tuner_state(tuner)}))
            tmp.replace(self.path)
        except OSError as e:  # a read-only cache folder: the tuner goes on without
            logger.warning("vllm-subspec: could not save the tuner's costs to %s: %s", self.path, e)
