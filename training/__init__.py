"""Train dFlash drafters and refiner heads (xPress, Markov) for any target the harness loads, with speculators.

Stages (python -m training <stage> --config NAME): prompts -> responses -> hidden -> train -> export; `all` runs
them in order and skips the stages whose outputs are already complete (each stage is resumable on its own).
"""
