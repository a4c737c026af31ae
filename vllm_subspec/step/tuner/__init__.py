"""The shape tuner (an auto shape's width, depth and lm_head) and the pieces it composes:
`tuner.ShapeTuner` (what the step session drives), `policy` (the plan across steps, `StepPlan`),
`choice`, `exploration`, `adaptive_depth` (within a step), `costs` (`StepCosts`, the cost
model), `acceptance`, `rate_guard`, `lm_head_choice`, `linear_cost`, and `step_timer` (the
session's clock of whole steps). Design: docs/shape_tuner.md.
"""
