"""From a config to a trained run: build (model, optimizer, sharded state, jitted steps) -> the loop (step, log, evaluate, save) -> checkpoints, metrics and the run summary in the workdir."""
